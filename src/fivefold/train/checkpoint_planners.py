"""How a checkpoint's tensors meet torch.distributed.checkpoint (DCP): what this rank writes
and reads, as boxes of logical tensors, and the checks that refuse another model.

`Chunked` describes this rank's parts of one logical tensor (views of its flat shards). The
save planner adds one DCP write item per part; the load planner adds the reads of each part
and refuses, with a one-line `ModelMismatch`, a tensor the checkpoint lacks, one it holds in
another shape than the model's logical one (a larger saved tensor is never read as a box),
and, on the coordinator with every rank's reads in hand, a saved tensor no rank reads (the
checkpoint holds more than this model). What counts is what the caller asks to read, so a
model that checkpoints only some tensors (LoRA adapters) is checked against those.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from fivefold.config import ConfigError
from fivefold.parallel import peak


class ModelMismatch(ConfigError):
    """A checkpoint of another model: a bad input (exit 2), never a reason to fall back to an
    older step of the same directory."""


@dataclass
class Chunked:
    """This rank's parts of one logical tensor: (offsets in the logical tensor, a view of
    this rank's data shaped like the box). `size` is the logical shape (needed to save;
    a load takes it from the checkpoint)."""

    size: tuple[int, ...]
    parts: list[tuple[tuple[int, ...], torch.Tensor]]


class ChunkedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner plus one write item per part of each `Chunked` tensor."""

    def __init__(self, chunked: dict[str, Chunked]):
        super().__init__()
        self.chunked = chunked
        self.parts = {(key, tuple(off)): t for key, c in chunked.items() for off, t in c.parts}

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = []
        for key, c in self.chunked.items():
            for offsets, t in c.parts:
                props = TensorProperties(dtype=t.dtype)
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape)
                items.append(WriteItem(
                    index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk, properties=props,
                                                size=torch.Size(c.size))))
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        part = self.parts.get((index.fqn, tuple(index.offset or ())))
        if part is not None:
            peak.sample("checkpoint save")
            return _exact_storage(part)
        return super().lookup_object(index)


_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _exact_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, behind a storage of exactly its bytes (no copy). DCP's file writer clones
    every tensor whose storage is larger than it, and keeps the clones of a file until the
    file is closed: given views of a flat shard, it would copy the whole shard. numpy can
    alias a slice of memory exactly (bf16 through a same-width integer view)."""
    if (t.device.type != "cpu" or not t.is_contiguous()
            or t.untyped_storage().nbytes() == t.nbytes):
        return t  # a device tensor is copied to the host whole anyway; a clipped box is small
    return torch.from_numpy(t.view(_SAME_WIDTH[t.element_size()]).numpy()).view(t.dtype)


class ChunkedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner plus reads into the parts of each `Chunked` tensor."""

    def __init__(self, chunked: dict[str, Chunked], path: Path):
        super().__init__()
        self.chunked, self.path = chunked, path
        self.parts = {(key, tuple(off)): t for key, c in chunked.items() for off, t in c.parts}

    def create_local_plan(self):
        """This rank's reads; a tensor the checkpoint lacks, or holds in another shape than
        the model's logical one, is a ModelMismatch (no box of a larger tensor is read)."""
        plan = super().create_local_plan()
        items = []
        for key, c in self.chunked.items():
            saved = self.metadata.state_dict_metadata.get(key)
            if key.startswith("fp8/") and not isinstance(saved, TensorStorageMetadata):
                continue  # saved without delayed FP8 scaling: its histories start empty
            if key.startswith("fp8/") and tuple(saved.size) != tuple(c.size):
                raise ModelMismatch(f"checkpoint {self.path} holds FP8 amax histories of "
                                    f"length {saved.size[-1]}, this run's are {c.size[-1]}; "
                                    f"set train.fp8_history_len = {saved.size[-1]}")
            if not isinstance(saved, TensorStorageMetadata):
                raise ModelMismatch(f"checkpoint {self.path} has no tensor {key}: it holds "
                                    f"another model; use a checkpoint of this model")
            if tuple(saved.size) != tuple(c.size):
                raise ModelMismatch(f"checkpoint {self.path} holds {key} with shape "
                                    f"{tuple(saved.size)}, but this model's is {tuple(c.size)};"
                                    f" use a checkpoint of this model")
            local = [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape)
                     for offsets, t in c.parts]
            items += create_read_items_for_chunk_list(key, saved, local)
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def create_global_plan(self, global_plan):
        """On the coordinator, with every rank's reads: each saved tensor must be read by
        some rank, so a checkpoint holding more than the model (another expert count, q/k
        norms the model lacks) is refused, not loaded in part."""
        read = {_logical(item.dest_index.fqn) for plan in global_plan for item in plan.items}
        read |= {_logical(key) for key in self.chunked}
        for key, saved in sorted(self.metadata.state_dict_metadata.items()):
            # fp8/: delayed FP8 scaling's amax histories, training state of that recipe
            # alone (lowp/delayed.py): inference and other recipes leave them unread
            if (isinstance(saved, TensorStorageMetadata) and "/" in key
                    and not key.startswith("fp8/") and _logical(key) not in read):
                raise ModelMismatch(f"checkpoint {self.path} holds {key} of shape "
                                    f"{tuple(saved.size)}, which this model does not have; "
                                    f"use a checkpoint of this model")
        return super().create_global_plan(global_plan)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        part = self.parts.get((index.fqn, tuple(index.offset or ())))
        if part is not None:
            peak.sample("checkpoint load")
            return part
        return super().lookup_tensor(index)


def _logical(key: str) -> str:
    """The tensor a key is about: `model/N` and `optim/N/exp_avg` are both N (an fp32 load
    reads the master copy, not `model/N`); `buffer/N` stays itself."""
    if key.startswith("model/"):
        return key.removeprefix("model/")
    if key.startswith("optim/"):
        return key.removeprefix("optim/").rsplit("/", 1)[0]
    return key
