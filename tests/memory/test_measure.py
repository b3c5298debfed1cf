"""The memory core: exact categories, agreement with an independent count, phases, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_lowmem.memory import CATEGORIES, mark_memory, measure_memory, parse_bytes, track_memory


def _adamw_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    optimizer.step()


def test_linear_adamw_categories_are_analytic():
    model = nn.Linear(1024, 1024)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 1024)
    _adamw_step(model, optimizer, x)  # first step creates the state; measure the second
    report = measure_memory(_adamw_step, model, optimizer, x)
    param_bytes = 4 * (1024 * 1024 + 1024)
    assert report.breakdown["parameters"] == pytest.approx(param_bytes, rel=0.01)
    assert report.breakdown["gradients"] == pytest.approx(param_bytes, rel=0.01)
    # exp_avg + exp_avg_sq per parameter, plus one float32 `step` scalar per parameter tensor
    assert report.breakdown["optimizer_state"] == pytest.approx(2 * param_bytes + 2 * 4, rel=0.01)
    assert sum(report.breakdown.values()) == report.peak_bytes
    assert set(report.phases) == {"forward", "backward", "optimizer"}


def test_transformer_peak_matches_torch_memtracker(tiny_gpt):
    from torch.distributed._tools.mem_tracker import MemTracker

    optimizer = torch.optim.AdamW(tiny_gpt.parameters())
    x = torch.randint(0, 256, (8, 16))

    def step() -> None:
        loss = F.cross_entropy(tiny_gpt(x).flatten(0, 1), x.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    report = measure_memory(step, module=tiny_gpt, optimizer=optimizer)
    tracker = MemTracker()
    tracker.track_external(tiny_gpt, optimizer)
    with tracker:
        step()
    independent = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert report.peak_bytes == pytest.approx(independent, rel=0.01)
    assert report.breakdown["activations"] > report.breakdown["parameters"]


def test_activations_are_what_backward_needs():
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    x = torch.randn(64, 256)
    with track_memory(model) as tracking:
        out = model(x)
        during_forward = tracking.current_bytes
        out.sum().backward()
    report = tracking.report
    forward = report.phases["forward"]["breakdown"]
    # saved: first Linear's output (tanh input) and tanh's output, each 64 x 256 float32
    assert forward["activations"] >= 2 * 64 * 256 * 4
    assert report.breakdown["gradients"] == sum(p.numel() * 4 for p in model.parameters())
    assert during_forward >= sum(p.numel() * 4 for p in model.parameters())


def test_by_module_names_submodules(tiny_mlp):
    with track_memory(tiny_mlp) as tracking:
        tiny_mlp(torch.randn(32, 16)).sum().backward()
    by_module = tracking.report.by_module
    assert {"fc1", "fc2", "head"} <= set(by_module)
    assert by_module["fc1"]["retained_bytes"] == 32 * 32 * 4  # its (32, 32) output


def test_frees_are_counted():
    with track_memory(device="cpu") as tracking:
        a = torch.empty(1000)
        del a
        b = torch.empty(500)
    assert tracking.report.peak_bytes == 4000
    assert tracking.report.end_bytes == 2000
    del b


def test_a_buffer_a_backend_thread_made_counts_from_when_it_is_first_seen():
    """gloo's reduce-scatter copies its input in a worker thread (invisible to the dispatch mode) and reads it back
    on wait: seen then for the first time, it must not count as alive since tracking began, once per collective."""
    import threading

    from lightning_lowmem.memory._tracker import active_tracker

    made: list[torch.Tensor] = []
    with track_memory(device="cpu") as tracking:
        early = torch.empty(1000)  # 4000 bytes: the peak before the collectives
        del early
        for _ in range(3):  # three collectives, each with its own backend copy (2000 bytes), freed after
            worker = threading.Thread(target=lambda: made.append(torch.empty(500)))
            worker.start()
            worker.join()
            with active_tracker().backend_allocations():
                made[-1].sum()  # the caller's thread reads the copy: its first sight of it
            made.pop()
    assert tracking.report.peak_bytes == 4000  # not 4000 + 3 x 2000 (every copy alive at the first peak)
    assert tracking.report.end_bytes == 0


def test_unseen_bytes_count_for_their_time_only():
    from lightning_lowmem.memory._tracker import active_tracker

    with track_memory(device="cpu") as tracking:
        kept = torch.empty(250)  # 1000 bytes
        with active_tracker().unseen_bytes(3000):  # e.g. gloo's all-gather staging buffer, in its own thread
            pass
        del kept
    assert tracking.report.peak_bytes == 4000 and tracking.report.breakdown["other"] == 4000
    assert tracking.report.end_bytes == 0


def test_optimizer_found_without_being_passed():
    model = nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    x = torch.randn(4, 64)
    report = measure_memory(_adamw_step, model, optimizer, x, optimizer=None)
    assert report.breakdown["optimizer_state"] >= 2 * 4 * (64 * 64 + 64)


def test_mark_memory_relabels_and_validates():
    with track_memory(device="cpu") as tracking:
        state = torch.zeros(256)
        mark_memory(state, "optimizer_state")
    assert tracking.report.breakdown["optimizer_state"] == 1024
    with pytest.raises(ValueError, match="`category`='weights' is not a memory category"):
        mark_memory(state, "weights")


def test_report_table_and_dict():
    report = measure_memory(lambda: torch.ones(10, 10).sum(), device="cpu")
    assert list(report.to_dict()["breakdown"]) == list(CATEGORIES)
    from rich.console import Console

    console = Console(record=True, width=100)
    console.print(report.to_table())
    assert "parameters" in console.export_text()


def test_measure_memory_rejects_non_callable():
    with pytest.raises(TypeError, match=r"`fn` must be callable .* got int: 3"):
        measure_memory(3)


def test_track_memory_rejects_bad_device_and_module():
    with pytest.raises(ValueError, match="`device`='tpu' is not supported"):
        with track_memory(device="tpu"):
            pass
    with pytest.raises(TypeError, match="`module` must be an nn.Module"):
        with track_memory(module="model"):
            pass


@pytest.mark.parametrize(
    ("text", "expected"), [("8GiB", 8 * 2**30), ("512 MB", 512 * 10**6), ("1.5kib", 1536), (1024, 1024)]
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["12GB?", "lots", "-1GiB", ""])
def test_parse_bytes_rejects(bad):
    with pytest.raises(ValueError, match="budget"):
        parse_bytes(bad, name="budget")


def test_a_bare_number_string_is_refused_with_its_unit_suggested_an_int_is_bytes():
    with pytest.raises(ValueError, match=r"`budget`='24' has no unit: did you mean '24GiB'\?"):
        parse_bytes("24", name="budget")
    assert parse_bytes("24B") == parse_bytes(24) == 24


@pytest.mark.cuda
def test_cuda_peak_matches_allocator():
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 1024, device="cuda")
    _adamw_step(model, optimizer, x)
    torch.cuda.synchronize()
    report = measure_memory(_adamw_step, model, optimizer, x)
    assert report.device == "cuda"
    assert report.peak_bytes == pytest.approx(report.device_stats["max_allocated"], rel=0.05)
    assert report.device_stats["fragmentation"] >= 0


def test_torchao_8bit_adamw_step_is_measured():
    # torchao steps each parameter through torch.compile(fullgraph=True), which cannot trace under the
    # tracker's dispatch mode; the tracker forces eager so the step runs and its state is counted
    pytest.importorskip("torchao")
    from lightning_lowmem.functional.optimizers.catalog import build_optimizer

    def measured_state(name: str) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
        optimizer = build_optimizer(name, model.parameters(), lr=1e-3)
        report = measure_memory(_adamw_step, model, optimizer, torch.randn(4, 256))  # first step: state created
        return report.breakdown["optimizer_state"]

    adamw_bytes, adamw8bit_bytes = measured_state("adamw"), measured_state("adamw8bit")
    assert adamw8bit_bytes > 0
    assert adamw8bit_bytes <= 0.3 * adamw_bytes
    # torch.compile compiles again once tracking ends (the eager stance is restored)
    graphs: list[int] = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(1)
        return graph_module.forward

    torch.compile(lambda x: x * 2, backend=counting_backend, fullgraph=True)(torch.ones(3))
    assert graphs == [1]
