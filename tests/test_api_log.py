"""Call logging (JITK_LOGLEVEL): each level's lines for every shipped op on fake CUDA tensors,
the real call path on CPU tensors (lines before the body, notes, the dispatcher, compiled
graphs), dumps with their limits and filters, replay, JITK_LOGDEST and bad settings."""

import json
import os
import re
import sys
import threading
from pathlib import Path

import pytest
import torch
from test_shipped_ops import calls, fake_cuda_tensor
from torch._subclasses.fake_tensor import FakeTensorMode

import jitk
import jitk.kernels.norm
from jitk.cli.main import main
from jitk.runtime import op as custom_op
from jitk.tools import api_log, call_dumps

body_calls = []  # (op, stdout so far) for each run of a test op's body


def _doubled_reference(x: torch.Tensor, out: torch.Tensor, scale: float = 2.0) -> None:
    out.copy_(x * scale)


@jitk.op("logtest::doubled", mutates_args=("out",), reference=_doubled_reference)
def doubled(x: torch.Tensor, out: torch.Tensor, scale: float = 2.0) -> None:
    """out = x * scale, on the CPU: a body that can run here."""
    if api_log.noting:
        api_log.note(kernel="Doubled<cpu>", tuned="none")
    print("BODY doubled", flush=True)
    out.copy_(x * scale)


@jitk.op("logtest::off_by_one", mutates_args=("out",), reference=_doubled_reference)
def off_by_one(x: torch.Tensor, out: torch.Tensor, scale: float = 2.0) -> None:
    """A wrong kernel: its reference says x * scale."""
    out.copy_(x * scale + 1)


@pytest.fixture
def logging_at(monkeypatch):
    """set(level, **settings) applies JITK_* settings to every op; undone afterwards."""
    def set_level(level, **more):
        monkeypatch.setenv(api_log.LEVEL_ENV, str(level))
        api_log._CALL_COUNTS.clear()  # process-wide: each test counts its calls from 1
        for name, value in more.items():
            monkeypatch.setenv(name, str(value))
        api_log.reload()

    yield set_level
    monkeypatch.undo()
    api_log.reload()


def lines_of(text):
    return [line for line in text.splitlines() if line.strip()]


# ------------------------------------------------------------------ every shipped op, faked
@pytest.mark.parametrize("level", [1, 3, 5, 10])
def test_each_level_logs_every_shipped_op_on_fake_cuda_tensors(level, capsys, tmp_path):
    config = api_log.Settings(level=level, dump_dir=tmp_path)
    api_log._CALL_COUNTS.clear()
    with FakeTensorMode():
        cases = calls(fake_cuda_tensor)
    for name, _, args, kwargs in cases:
        info = custom_op.find_op(f"jitk::{name}")
        ran = []  # stands in for the body: what was written before it ran
        body = lambda *a, ran=ran, **k: ran.append(capsys.readouterr().out)
        logged = api_log.wrap(info.name, body, info.signature, info.mutates_args, config)
        logged(*args, **kwargs)
        before = lines_of(ran[0])
        assert re.fullmatch(rf"\[jitk pid {os.getpid()} [\d:]+\] jitk::{name} call 1", before[0])
        if level == 1:
            assert len(before) == 1
            continue
        bound = info.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        for parameter, value in bound.arguments.items():
            line = next(li for li in before if li.startswith(f"  {parameter}: "))
            if isinstance(value, torch.Tensor):
                dtype = str(value.dtype).removeprefix("torch.")
                assert (f"shape={tuple(value.shape)}, dtype={dtype}, strides={value.stride()}, "
                        f"device={value.device}, data_ptr=none (no storage)") in line, line
            else:
                assert line.endswith(repr(value)), line
        stats = [li for li in before if " stats: " in li]
        if level == 3:
            assert not stats
            continue
        assert "statistics synchronize the device" in before[1]
        tensors = [p for p, v in bound.arguments.items() if isinstance(v, torch.Tensor)]
        assert [li.split()[0] for li in stats] == tensors
        assert all(li.endswith("no data (a fake or meta tensor)") for li in stats)
        after = lines_of(capsys.readouterr().out)
        assert [li.split(": ")[1] for li in after] == [
            f"{p} stats" for p in tensors if p in info.mutates_args]
    assert not list(tmp_path.iterdir()), "fake tensors have no data to dump"


# ---------------------------------------------------------------------- the real call path
def test_level_0_leaves_every_op_calling_its_body(logging_at):
    logging_at(0)
    assert not api_log.noting
    for info in custom_op.registered_ops().values():
        if not info.uses_reference():
            assert info.slot["_jitk_fn"] is info.fn, info.name


def test_lines_and_notes_are_written_before_the_body_on_both_call_paths(logging_at, capsys):
    logging_at(3)
    x, out = torch.arange(6.0).view(2, 3).t(), torch.empty(3, 2)
    doubled(x, out)
    torch.ops.logtest.doubled(x, out, 3.0)
    text = capsys.readouterr().out
    first, second = text.split("BODY doubled\n")[:2]
    assert lines_of(first) == [
        lines_of(first)[0],
        f"  x: Tensor(shape=(3, 2), dtype=float32, strides=(1, 3), device=cpu, "
        f"data_ptr=0x{x.data_ptr():x})",
        f"  out: Tensor(shape=(3, 2), dtype=float32, strides=(2, 1), device=cpu, "
        f"data_ptr=0x{out.data_ptr():x})",
        "  scale: float 2.0",
        "  note: kernel=Doubled<cpu>, tuned=none"]
    assert lines_of(first)[0].endswith("logtest::doubled call 1")
    assert lines_of(second)[0].endswith("logtest::doubled call 2")  # through the dispatcher
    assert "  scale: float 3.0" in lines_of(second)


def test_a_shipped_op_logs_its_kernel_before_the_launch_that_fails(logging_at, capsys):
    logging_at(3)
    x, weight = torch.ones(4, 128, dtype=torch.bfloat16), torch.ones(128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="Device mismatch"):  # CPU tensors reach the kernel
        jitk.rmsnorm(x, weight)
    logged = lines_of(capsys.readouterr().out)
    assert logged[0].endswith("jitk::rmsnorm call 1")
    assert "  input: Tensor(shape=(4, 128), dtype=bfloat16, strides=(128, 1), device=cpu" in \
        logged[1]
    assert logged[-1] == ("  note: kernel=jitk::norm::RMSNorm<128, bf16_t>, rows_bucket=4, "
                          "tuning=default")
    with pytest.raises(RuntimeError, match="Device mismatch"):  # the same shape again
        jitk.rmsnorm(x, weight)
    again = lines_of(capsys.readouterr().out)
    assert again[0].endswith("jitk::rmsnorm call 2") and again[-1] == logged[-1]


def test_level_5_statistics_before_and_after(logging_at, capsys):
    logging_at(5)
    x = torch.tensor([1.0, float("nan"), -3.0, float("inf")])
    doubled(x, torch.zeros(4))
    logged = lines_of(capsys.readouterr().out)
    assert "    x stats: min=-3, max=1, mean=-1, nan=1, inf=1" in logged
    assert "    out stats: min=0, max=0, mean=0, nan=0, inf=0" in logged
    assert logged[-1].endswith("call 1: out stats: min=-6, max=2, mean=-2, nan=1, inf=1")


def test_nothing_is_logged_while_torch_compile_traces(logging_at, capsys):
    logging_at(1)
    x, out = torch.ones(3), torch.empty(3)
    compiled = torch.compile(lambda a, b: doubled(a, b), fullgraph=True, backend="eager")
    compiled(x, out)
    compiled(x, out)
    headers = [li for li in lines_of(capsys.readouterr().out) if "logtest::doubled" in li]
    assert [h.split("] ")[1] for h in headers] == ["logtest::doubled call 1",
                                                   "logtest::doubled call 2"]  # runs only


def test_logdest_path_with_pid(logging_at, tmp_path, capsys):
    logging_at(1, JITK_LOGDEST=tmp_path / "calls-%i.log")
    doubled(torch.ones(2), torch.empty(2))
    log = tmp_path / f"calls-{os.getpid()}.log"
    assert lines_of(log.read_text())[0].endswith("logtest::doubled call 1")
    assert "jitk" not in capsys.readouterr().out


@pytest.mark.parametrize("name, value, message", [
    ("JITK_LOGLEVEL", "2", "JITK_LOGLEVEL='2': expected one of 0, 1, 3, 5, 10"),
    ("JITK_LOGLEVEL", "verbose", "JITK_LOGLEVEL='verbose': expected one of"),
    ("JITK_DUMP_MAX_GB", "-1", "JITK_DUMP_MAX_GB='-1': expected a number of GiB >= 0"),
    ("JITK_DUMP_MAX_COUNT", "2.5", "JITK_DUMP_MAX_COUNT='2.5': expected a whole number >= 0"),
    ("JITK_DUMP_INCLUDE", "jitk::*,", "JITK_DUMP_INCLUDE='jitk::*,': expected a comma-separated"),
])
def test_bad_settings_name_their_variable(monkeypatch, name, value, message):
    with pytest.raises(jitk.SettingError, match=re.escape(message)):
        api_log.settings_from({"JITK_LOGLEVEL": "10", name: value})
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        api_log.reload()  # fails before changing anything


# ---------------------------------------------------------------------- dumps and replay
def dumps_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir())


def test_a_dump_replays_against_its_outputs_and_the_reference(logging_at, tmp_path, capsys):
    logging_at(10, JITK_DUMP_DIR=tmp_path)
    x = torch.randn(5, 3).t()  # strided: replay rebuilds the strides
    doubled(x, torch.empty(3, 5), 0.5)
    off_by_one(x, torch.empty(3, 5))
    good, bad = dumps_in(tmp_path)
    call = json.loads((good / call_dumps.CALL_FILE).read_text())
    assert call["op"] == "logtest::doubled" and call["outputs"] == ["out"]
    assert call["tensors"]["x"]["strides"] == [1, 3]
    assert call["arguments"]["scale"] == {"value": 0.5}
    capsys.readouterr()
    logging_at(0)
    assert main(["replay", str(good)]) == 0
    report = capsys.readouterr().out
    assert "op: matches the 1 dumped output(s)" in report
    assert "reference: matches the 1 dumped output(s)" in report
    assert main(["replay", str(bad)]) == 1  # the kernel reproduces; its reference disagrees
    report = capsys.readouterr().out
    assert "op: matches" in report and "reference: FAILED" in report


def test_a_call_that_raises_is_dumped_with_its_error(logging_at, tmp_path, capsys):
    logging_at(10, JITK_DUMP_DIR=tmp_path)
    with pytest.raises(RuntimeError):
        doubled(torch.ones(3), torch.empty(4))
    (dump,) = dumps_in(tmp_path)
    call = json.loads((dump / call_dumps.CALL_FILE).read_text())
    assert call["raised"].startswith("RuntimeError: ") and call["outputs"] == []
    logging_at(0)
    assert main(["replay", str(dump)]) == 1
    assert "op: FAILED\n    raised RuntimeError" in capsys.readouterr().out


def test_dump_count_limit_and_filters(logging_at, tmp_path, capsys):
    logging_at(10, JITK_DUMP_DIR=tmp_path, JITK_DUMP_MAX_COUNT=1,
               JITK_DUMP_EXCLUDE="logtest::off*")
    for _ in range(3):
        off_by_one(torch.ones(2), torch.empty(2))  # excluded
        doubled(torch.ones(2), torch.empty(2))
    assert [p.name.split("_pid")[0] for p in dumps_in(tmp_path)] == ["logtest.doubled"]
    assert capsys.readouterr().out.count("no more dumps: JITK_DUMP_MAX_COUNT=1") == 1
    logging_at(10, JITK_DUMP_DIR=tmp_path / "b", JITK_DUMP_INCLUDE="*::off_by_one",
               JITK_DUMP_EXCLUDE="")
    doubled(torch.ones(2), torch.empty(2))
    off_by_one(torch.ones(2), torch.empty(2))
    assert [p.name.split("_pid")[0] for p in dumps_in(tmp_path / "b")] == ["logtest.off_by_one"]


def exit_code(argv: list[str]) -> int:
    """main()'s exit status; bad usage exits 2 through argparse."""
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


def test_dump_size_limit(logging_at, tmp_path, capsys):
    logging_at(10, JITK_DUMP_DIR=tmp_path, JITK_DUMP_MAX_GB=2**-20)  # 1 KiB
    doubled(torch.ones(16), torch.empty(16))  # 2 x 2 x 64 bytes: fits
    doubled(torch.ones(256), torch.empty(256))  # 4 KiB: refused
    assert len(dumps_in(tmp_path)) == 1
    assert "no more dumps: JITK_DUMP_MAX_GB=9.53674e-07 would be exceeded" in \
        capsys.readouterr().out


def test_level_10_without_safetensors_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # its import raises ImportError
    with pytest.raises(ValueError, match=r"JITK_LOGLEVEL=10 dumps tensors as safetensors, "
                                         r"which is not installed: pip install safetensors"):
        api_log.settings_from({"JITK_LOGLEVEL": "10"})
    assert api_log.settings_from({"JITK_LOGLEVEL": "5"}).level == 5


@pytest.mark.gpu
def test_levels_above_3_log_as_3_inside_graph_capture(logging_at, capsys):
    logging_at(5)
    x, out = torch.ones(8, device="cuda"), torch.empty(8, device="cuda")
    doubled(x, out)  # warm-up outside the capture
    capsys.readouterr()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        doubled(x, out)
        doubled(x, out)
    logged = capsys.readouterr().out
    assert logged.count("logs as level 3 while capturing; said once") == 1
    assert " stats: " not in logged and logged.count("  x: Tensor(shape=(8,)") == 2


def test_replay_refuses_what_is_not_a_dump(tmp_path, capsys):
    assert exit_code(["replay", str(tmp_path / "missing")]) == 2
    (tmp_path / call_dumps.CALL_FILE).write_text("{")
    assert exit_code(["replay", str(tmp_path)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err


def test_reference_mode_dumps_name_the_defining_module_and_replay(logging_at, tmp_path, capsys):
    logging_at(10, JITK_DUMP_DIR=tmp_path)
    with pytest.warns(UserWarning, match="reference mode"), jitk.reference_mode("doubled"):
        doubled(torch.ones(4), torch.empty(4))
    (dump,) = dumps_in(tmp_path)
    assert json.loads((dump / call_dumps.CALL_FILE).read_text())["module"] == __name__
    logging_at(0)
    assert main(["replay", str(dump)]) == 0


def test_two_wrappers_of_one_op_share_its_call_numbers(logging_at, tmp_path, capsys):
    # A reload wraps every op anew; the op's count goes on, so no two dumps share a number.
    logging_at(10, JITK_DUMP_DIR=tmp_path)
    doubled(torch.ones(2), torch.empty(2))
    api_log.reload()
    doubled(torch.ones(2), torch.empty(2))
    headers = [li for li in lines_of(capsys.readouterr().out) if "] logtest::" in li]
    assert [h.split("] ")[1] for h in headers] == ["logtest::doubled call 1",
                                                   "logtest::doubled call 2"]
    assert [p.name.rsplit("_call", 1)[1] for p in dumps_in(tmp_path)] == ["000001", "000002"]


def test_dumps_never_reuse_a_folder(logging_at, tmp_path):
    # Call numbers restart here (the fixture resets them): call 1 takes a new folder.
    logging_at(10, JITK_DUMP_DIR=tmp_path)
    with pytest.raises(RuntimeError):
        doubled(torch.ones(3), torch.empty(4))
    (first,) = dumps_in(tmp_path)
    logging_at(10, JITK_DUMP_DIR=tmp_path)
    doubled(torch.ones(4), torch.empty(4))
    assert len(dumps_in(tmp_path)) == 2
    assert "raised" in json.loads((first / call_dumps.CALL_FILE).read_text())


def test_a_dump_that_cannot_be_written_warns_once_and_the_call_runs(logging_at, tmp_path,
                                                                      monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    logging_at(10, JITK_DUMP_DIR=blocker / "dumps")  # under a file: mkdir fails
    monkeypatch.setattr(call_dumps, "failure_warned", threading.Event())
    out = torch.empty(4)
    with pytest.warns(RuntimeWarning, match=r"cannot write the level-10 dump .*dumps") as w:
        doubled(torch.ones(4), out)
        doubled(torch.ones(4), out)
    assert len([x for x in w if "level-10 dump" in str(x.message)]) == 1
    torch.testing.assert_close(out, torch.full((4,), 2.0))
