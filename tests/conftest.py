import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models, as the multi-rank tests' forked
    children use: on a shared 2-core machine two spinning OpenMP threads made each small GEMM
    10-30x slower. Modules take it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
