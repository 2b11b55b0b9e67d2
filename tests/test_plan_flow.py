"""plan/ as a one-way flow: workload -> terms -> items -> search (../STYLE.md's shape).

Every module of plan/ sits in one layer, and imports only from the layers it may read. The
imports are read from the source as tests/test_structure.py reads them (every `import`, at
module level or inside a function), so a deferred import that reaches back is caught too.

    workload  plain data and vocabulary: the layout, the workload, pipeline placement, the
              hardware, a convention's defaults, the validated ranges
    terms     each a function of (workload, layout, hardware): memory, activations, model
              states, communication, network, time, FLOPs, offload tiers, ...
    items     one layout's answers assembled from the terms (evaluate.py), and the cheap
              questions the search asks before a whole plan (bounds.py)
    inputs    a training config read into a workload and a layout
    search    tries layouts: reads items, never a term
    outputs   the CLI, reports, plots, serving's plan: may read anything
"""

from __future__ import annotations

from test_structure import _imports, _modules

PLAN = "fivefold.plan"
LAYERS = {
    "workload": {"layout", "placement", "split", "hardware", "conventions", "validated"},
    "terms": {"activations", "allocator", "comm", "comm_buffers", "flops", "fp8", "fp8_linears",
              "grad_sync", "lora", "memory", "model_states", "network", "nvme", "optimizer",
              "recompute_costs", "recompute_plan", "timing", "torch_pipelining"},
    "items": {"evaluate", "bounds"},
    "inputs": {"inputs"},
    "search": {"search", "auto_layout"},
    "outputs": {"", "advice", "cli_args", "cli_entry", "plots", "recompute_auto", "report",
                "run_cost", "serve"},  # "": the package's __init__, which imports them all
}
MAY_READ = {
    "workload": {"workload"},
    "terms": {"workload", "terms"},
    "items": {"workload", "terms", "items"},
    # grad_sync: a config's "auto" is resolved for its own layout as plan_layout resolves it
    "inputs": {"workload", "terms"},
    "search": {"workload", "items", "inputs", "search"},
    "outputs": set(LAYERS),
}
# The one crossing allowed: the stage split (split.py, shared with the engine) weighs a
# layer by its matmul weights per token, which flops.py counts.
EXCEPTIONS = {("split", "flops")}


def _short(module: str) -> str:
    return module[len(PLAN) + 1:] if module != PLAN else ""


def _layer_of(short: str) -> str | None:
    return next((layer for layer, members in LAYERS.items() if short in members), None)


def _violations(graph: dict[str, set[str]]) -> list[str]:
    """'a (layer) imports b (layer)' for every import of plan/ against MAY_READ."""
    out = []
    for module, imported in sorted(graph.items()):
        if module != PLAN and not module.startswith(PLAN + "."):
            continue
        src = _short(module)
        for target in sorted(imported):
            if target != PLAN and not target.startswith(PLAN + "."):
                continue
            dst = _short(target)
            if (src, dst) in EXCEPTIONS:
                continue
            if _layer_of(dst) not in MAY_READ[_layer_of(src)]:
                out.append(f"plan/{src or '__init__'}.py ({_layer_of(src)}) imports "
                           f"plan/{dst or '__init__'}.py ({_layer_of(dst)})")
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()
            if m == PLAN or m.startswith(PLAN + ".")}


def test_every_plan_module_has_a_layer():
    unplaced = sorted(_short(m) for m in _graph() if _layer_of(_short(m)) is None)
    assert not unplaced, f"plan/ modules in no layer of tests/test_plan_flow.py: {unplaced}"


def test_plan_imports_run_one_way():
    bad = _violations(_graph())
    assert not bad, "imports against plan/'s flow:\n" + "\n".join(bad)


def test_search_reads_no_term():
    # The brief's rule in its plainest form, apart from the table above.
    graph = _graph()
    terms = {f"{PLAN}.{t}" for t in LAYERS["terms"]}
    for searcher in ("search", "auto_layout"):
        reached = graph[f"{PLAN}.{searcher}"] & terms
        assert not reached, f"plan/{searcher}.py imports terms: {sorted(reached)}"


def test_the_check_finds_an_import_against_the_flow():
    # The checker itself: a search reaching into a term, a term reading the items, and a
    # deferred import of the package from a term are each found; the allowed ones are not.
    graph = {
        f"{PLAN}.search": {f"{PLAN}.timing", f"{PLAN}.evaluate"},
        f"{PLAN}.memory": {f"{PLAN}.evaluate", f"{PLAN}.layout"},
        f"{PLAN}.nvme": {PLAN},
        f"{PLAN}.split": {f"{PLAN}.flops"},
        f"{PLAN}.auto_layout": {f"{PLAN}.bounds", f"{PLAN}.inputs", "fivefold.config"},
    }
    assert _violations(graph) == [
        "plan/memory.py (terms) imports plan/evaluate.py (items)",
        "plan/nvme.py (terms) imports plan/__init__.py (outputs)",
        "plan/search.py (search) imports plan/timing.py (terms)",
    ]
