"""jitk.autotune on the host: the tuning file (merge, atomic replace, a corrupt, foreign-GPU,
older-version or out-of-space file ignored with one warning), lookups per shape bucket, and
two processes recording at once losing no entry. Timing candidates needs a GPU (marked)."""

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import jitk
from jitk.tools import autotune, timing, tuning_store

BUILT = []  # (bucket, config) of every build the space below was asked for


def _reference(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x)


@jitk.op("jitk_tune::copy", mutates_args=("out",), reference=_reference)
def copy(x: torch.Tensor, out: torch.Tensor) -> None:
    copy.info.tuning.lookup((x.numel(),))(x, out)


def _build(bucket, config):
    BUILT.append((bucket, config))
    return lambda x, out: out.copy_(x)


SPACE = autotune.TuningSpace({"threads": (128, 256), "unroll": (1, 2)},
                             bucket=lambda x, out: (x.numel(),),
                             default=lambda bucket: {"threads": 128, "unroll": 1},
                             # at 12 elements unroll 2 is never tried (nor taken from a file)
                             allowed=lambda bucket, c: bucket != (12,) or c["unroll"] == 1,
                             build=_build).attach(copy)


@pytest.fixture(autouse=True)
def fresh_file(tmp_path, monkeypatch):
    monkeypatch.setenv("JITK_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(SPACE, "tables", tmp_path / "tables")
    tuning_store.reread()
    SPACE.forget()
    BUILT.clear()
    yield tmp_path / autotune.FILE_NAME
    tuning_store.reread()
    SPACE.forget()


def entry(bucket, config, **environment):
    return {"op": "jitk_tune::copy", "bucket": list(bucket), "config": config,
            "environment": {**autotune.environment(), **environment}}


def call(n):
    x = torch.arange(n, dtype=torch.float32)
    out = torch.empty_like(x)
    copy(x, out)
    torch.testing.assert_close(out, x)


def test_without_a_file_the_default_applies_and_is_cached_per_bucket(fresh_file):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(8)
        call(8)
        call(9)
    assert BUILT == [((8,), {"threads": 128, "unroll": 1}), ((9,), {"threads": 128, "unroll": 1})]
    assert not fresh_file.exists()  # lookups never write


def test_a_recorded_choice_is_used_and_records_merge(fresh_file):
    autotune.record([entry((8,), {"threads": 256, "unroll": 2})])
    autotune.record([entry((9,), {"threads": 256, "unroll": 1})])
    autotune.record([entry((8,), {"threads": 128, "unroll": 2})])  # replaces bucket 8's
    call(8)
    call(9)
    assert BUILT == [((8,), {"threads": 128, "unroll": 2}), ((9,), {"threads": 256, "unroll": 1})]
    document = json.loads(fresh_file.read_text())
    assert document["format"] == autotune.FORMAT and len(document["entries"]) == 2
    assert not list(fresh_file.parent.glob(".*.tmp"))  # the staging file was renamed


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot be read"),
    (json.dumps({"format": 99, "entries": []}), "is not a jitk tuning file of format 1"),
    (json.dumps({"format": 1, "entries": [{"op": "x"}]}), "has malformed entries"),
])
def test_a_corrupt_file_is_ignored_with_one_warning(fresh_file, content, message):
    fresh_file.write_text(content)
    with pytest.warns(UserWarning, match=message) as caught:
        call(8)
        call(8)
        call(9)
    assert len(caught) == 1
    assert {config["threads"] for _, config in BUILT} == {128}


@pytest.mark.parametrize("foreign", [{"gpu": "NVIDIA B200", "sms": 148}, {"jitk": "0.0.1"},
                                     {"torch": "2.1.0"}, {"tvm_ffi": "0.0.1"},
                                     {"driver": "11.0"}])
def test_entries_for_another_gpu_or_versions_are_ignored_with_one_warning(fresh_file, foreign):
    autotune.record([entry((8,), {"threads": 256, "unroll": 2}, **foreign),
                     entry((9,), {"threads": 256, "unroll": 2})])
    with pytest.warns(UserWarning, match="1 of 2 entries .* another GPU or other versions") \
            as caught:
        call(8)
        call(9)
    assert len(caught) == 1
    assert BUILT == [((8,), {"threads": 128, "unroll": 1}), ((9,), {"threads": 256, "unroll": 2})]


def test_a_choice_outside_the_space_is_ignored_with_a_warning(fresh_file):
    autotune.record([entry((8,), {"threads": 512, "unroll": 1})])
    with pytest.warns(UserWarning, match="not in this jitk's space"):
        call(8)
    assert BUILT == [((8,), {"threads": 128, "unroll": 1})]


def ship(entries, gpu="NVIDIA H100 80GB HBM3", sms=132, name=None):
    """A shipped table in the space's tables folder, for `gpu` (named as table_name says)."""
    SPACE.tables.mkdir(exist_ok=True)
    path = SPACE.tables / (name or autotune.table_name(gpu))
    path.write_text(json.dumps({"format": autotune.FORMAT, "gpu": gpu, "sms": sms,
                                "entries": [{"op": "jitk_tune::copy", "bucket": list(b),
                                             "config": c} for b, c in entries]}))
    return path


@pytest.fixture
def h100(monkeypatch):
    """This process on a made-up H100: what the tuning file and the tables are keyed by."""
    monkeypatch.setattr(tuning_store, "_ENVIRONMENT", {**autotune.environment(),
                                                   "gpu": "NVIDIA H100 80GB HBM3", "sms": 132})


def test_a_process_without_a_gpu_reads_the_table_jitk_tuned_for_names(fresh_file, monkeypatch):
    """precompile's workers see no GPU: named the parent's, they list the table's choices."""
    monkeypatch.setattr(tuning_store, "_ENVIRONMENT", {**autotune.environment(), "gpu": "none",
                                                       "sms": 0})
    ship([((8,), {"threads": 256, "unroll": 1})])
    assert tuning_store.table_configs(SPACE.tables) == {}
    monkeypatch.setenv("JITK_TUNED_FOR", "NVIDIA H100 80GB HBM3,132")
    assert SPACE.recorded() == [([8], {"threads": 256, "unroll": 1})]
    monkeypatch.setenv("JITK_TUNED_FOR", "NVIDIA H100 80GB HBM3,114")  # another SM count
    assert tuning_store.table_configs(SPACE.tables) == {}
    monkeypatch.setenv("JITK_TUNED_FOR", "NVIDIA H100")
    with pytest.raises(jitk.SettingError, match="JITK_TUNED_FOR='NVIDIA H100': expected"):
        tuning_store.table_configs(SPACE.tables)


def test_table_names_are_the_gpu_name_in_lower_case_words():
    assert autotune.table_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3.json"
    assert autotune.table_name("NVIDIA GeForce RTX 4090 (D)") == "nvidia-geforce-rtx-4090-d.json"


def test_lookup_order_process_then_file_then_shipped_table_then_default(fresh_file, h100):
    ship([((8,), {"threads": 256, "unroll": 1}), ((9,), {"threads": 256, "unroll": 1}),
          ((10,), {"threads": 128, "unroll": 2})])
    autotune.record([entry((9,), {"threads": 128, "unroll": 2})])  # the user's own tuning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (8, 9, 10, 11):
            call(n)
    assert BUILT == [((8,), {"threads": 256, "unroll": 1}),   # the table: the file has none
                     ((9,), {"threads": 128, "unroll": 2}),   # the file overrides the table
                     ((10,), {"threads": 128, "unroll": 2}),  # the table
                     ((11,), {"threads": 128, "unroll": 1})]  # neither: the default
    assert SPACE.config((8,)) == {"threads": 256, "unroll": 1}
    SPACE._chosen[(8,)] = lambda x, out: out.copy_(x)  # a choice made in this process wins
    assert SPACE.lookup((8,)) is SPACE._chosen[(8,)]


@pytest.mark.parametrize("other", [{"gpu": "NVIDIA H100 PCIe"}, {"sms": 114}])
def test_a_table_for_another_gpu_is_not_used(fresh_file, h100, other):
    """A table under this GPU's file name but tuned on another GPU or SM count: the default."""
    ship([((8,), {"threads": 256, "unroll": 1})],
         **{"gpu": "NVIDIA H100 80GB HBM3", "sms": 132, **other},
         name=autotune.table_name("NVIDIA H100 80GB HBM3"))
    call(8)
    assert BUILT == [((8,), {"threads": 128, "unroll": 1})]


def test_a_shipped_choice_the_space_does_not_try_is_passed_over(fresh_file, h100):
    ship([((12,), {"threads": 256, "unroll": 2}), ((10,), {"threads": 512, "unroll": 1})])
    with pytest.warns(UserWarning, match="shipped table's choice .* passed over") as caught:
        call(12)
        call(10)
    assert len(caught) == 2
    assert BUILT == [((12,), {"threads": 128, "unroll": 1}),
                     ((10,), {"threads": 128, "unroll": 1})]


def test_a_file_choice_the_space_no_longer_tries_is_passed_over(fresh_file):
    autotune.record([entry((12,), {"threads": 128, "unroll": 2})])
    with pytest.warns(UserWarning, match="tuning file's choice .* passed over"):
        call(12)
    assert BUILT == [((12,), {"threads": 128, "unroll": 1})]


def test_an_unreadable_table_warns_and_the_default_applies(fresh_file, h100):
    SPACE.tables.mkdir()
    (SPACE.tables / autotune.table_name("NVIDIA H100 80GB HBM3")).write_text("{not json")
    with pytest.warns(UserWarning, match="shipped tuning table .* cannot be used"):
        call(8)
    assert BUILT == [((8,), {"threads": 128, "unroll": 1})]


def test_export_table_writes_this_gpus_entries_of_the_ops_and_a_lookup_uses_it(fresh_file, h100):
    autotune.record([entry((8,), {"threads": 256, "unroll": 1}),
                     entry((9,), {"threads": 128, "unroll": 2}, gpu="NVIDIA B200", sms=148),
                     {**entry((10,), {"threads": 256, "unroll": 1}), "op": "other::op"}])
    path = SPACE.tables / autotune.table_name("NVIDIA H100 80GB HBM3")
    assert autotune.export_table(["jitk_tune::copy"], path) == 1
    table = json.loads(path.read_text())
    assert (table["gpu"], table["sms"], table["format"]) == ("NVIDIA H100 80GB HBM3", 132, 1)
    assert table["entries"] == [{"op": "jitk_tune::copy", "bucket": [8],
                                 "config": {"threads": 256, "unroll": 1}}]
    fresh_file.unlink()  # the table alone now
    tuning_store.reread()
    call(8)
    assert BUILT == [((8,), {"threads": 256, "unroll": 1})]


def test_precompile_builds_the_shipped_tables_choices_too(fresh_file, h100):
    ship([((8,), {"threads": 256, "unroll": 1})])
    autotune.record([entry((9,), {"threads": 128, "unroll": 2})])
    assert SPACE.recorded() == [([9], {"threads": 128, "unroll": 2}),
                                ([8], {"threads": 256, "unroll": 1})]


def test_candidates_start_with_the_default():
    assert SPACE.candidates((8,)) == [{"threads": 128, "unroll": 1}, {"threads": 128, "unroll": 2},
                                      {"threads": 256, "unroll": 1}, {"threads": 256, "unroll": 2}]


def test_candidates_are_worked_out_once_a_bucket():
    """`allowed` sees each combination once a bucket (and beside-ness), however often the
    candidates are asked for; each answer is the caller's own to change."""
    asked = []

    def allowed(bucket, config):
        asked.append((bucket, config["threads"], config["unroll"]))
        return config["unroll"] == 2

    space = autotune.TuningSpace({"threads": (128, 256), "unroll": (1, 2)}, bucket=len,
                                 default=lambda bucket: {"threads": 128, "unroll": 1},
                                 build=_build, allowed=allowed)
    first = space.candidates((8,))
    first[0]["threads"] = 0
    assert space.candidates((8,)) == [{"threads": 128, "unroll": 1},
                                      {"threads": 128, "unroll": 2}, {"threads": 256, "unroll": 2}]
    assert len(asked) == 3  # every combination but the default, once
    space.candidates((16,))
    assert len(asked) == 6


def test_space_declaration_errors():
    with pytest.raises(ValueError, match="knobs must map"):
        autotune.TuningSpace({"threads": ()}, bucket=len, default=dict, build=_build)
    with pytest.raises(TypeError, match="'build' must be a function"):
        autotune.TuningSpace({"threads": (1,)}, bucket=len, default=dict, build=None)
    with pytest.raises(ValueError, match=r"beside_knobs names no knob: \['pdl'\]"):
        autotune.TuningSpace({"threads": (1,)}, bucket=len, default=dict, build=_build,
                             neighbour=lambda args, kwargs: print, beside_knobs=("pdl",))
    with pytest.raises(ValueError, match="beside_knobs need a neighbour"):
        autotune.TuningSpace({"pdl": (True, False)}, bucket=len, default=dict, build=_build,
                             beside_knobs=("pdl",))


def test_beside_knobs_leave_their_default_only_beside_the_neighbour():
    seen = []

    def allowed(bucket, config):
        seen.append(config["pdl"])
        return config["threads"] != 512

    space = autotune.TuningSpace(
        {"threads": (128, 256, 512), "pdl": (True, False)}, bucket=len, build=_build,
        default=lambda bucket: {"threads": 128, "pdl": True}, allowed=allowed,
        neighbour=lambda args, kwargs: print, beside_knobs=("pdl",))
    assert space.candidates((8,)) == [{"threads": 128, "pdl": True},
                                      {"threads": 256, "pdl": True}]
    assert space.candidates((8,), beside=True) == [
        {"threads": 128, "pdl": True}, {"threads": 128, "pdl": False},
        {"threads": 256, "pdl": True}, {"threads": 256, "pdl": False}]
    assert set(seen) == {True}  # allowed judges the other knobs, the beside ones at default


def test_tuning_beside_needs_a_neighbour():
    # Refused before anything is built or timed, GPU or not.
    with pytest.raises(ValueError, match="jitk_tune::copy's tuning space names no neighbour"):
        autotune.tune(copy, (torch.ones(4), torch.empty(4)), beside=True)
    assert BUILT == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_tune_needs_a_gpu():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        autotune.tune(copy, (torch.ones(4), torch.empty(4)))


class FakeGpu:
    """Stands in for torch.cuda in autotune._time_rounds: records sleeps and runs, and wakes
    from each round's sleep before the host has queued the round as often as `early_wakes`.
    A run takes 1 ms of its clock."""

    def __init__(self, early_wakes: int):
        self.early_wakes, self.sleeps, self.ran = early_wakes, [], []
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = 0.0

            def record(self):
                self.at = len(gpu.ran)

            def query(self):  # the GPU is past the sleep: it woke while the host queued
                if gpu.early_wakes:
                    gpu.early_wakes -= 1
                    return True
                return False

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return end.at - self.at

        self.Event = Event

    def run(self, name):
        return lambda: self.ran.append(name)


@pytest.fixture
def fake_gpu(monkeypatch):
    def make(early_wakes=0):
        gpu = FakeGpu(early_wakes)
        monkeypatch.setattr(torch.cuda, "Event", gpu.Event)
        monkeypatch.setattr(torch.cuda, "_sleep", gpu.sleeps.append)
        return gpu
    return make


def test_timing_rounds_rotate_and_a_round_queued_too_late_is_taken_again(fake_gpu):
    gpu = fake_gpu(early_wakes=2)
    times = autotune._time_rounds([gpu.run(name) for name in "abc"], per_run=4, rounds=2)
    assert times == [[1e3 / 4] * 2] * 3  # us per call, a round each: one fake ms a run of 4
    sleep = autotune.SLEEP_CYCLES_PER_RUN * 3
    # Round 1 was queued twice too late: taken again behind a sleep twice, then four times,
    # as long; round 2 keeps the longer sleep and starts one run further on.
    assert gpu.sleeps == [sleep, 2 * sleep, 4 * sleep, 4 * sleep]
    assert "".join(gpu.ran) == "abc" * 3 + "bca"


def test_single_calls_each_wait_behind_a_pause_of_their_own(fake_gpu):
    gpu = fake_gpu()
    autotune._time_rounds([gpu.run("a"), gpu.run("b")], per_run=1, rounds=1, pause_cycles=7)
    assert gpu.sleeps == [autotune.SLEEP_CYCLES_PER_RUN * 2, 7, 7] and gpu.ran == ["a", "b"]


def test_timing_gives_up_when_the_host_never_keeps_ahead(fake_gpu):
    gpu = fake_gpu(early_wakes=10 ** 6)
    with pytest.raises(RuntimeError, match="did not queue 2 runs within a GPU sleep"):
        autotune._time_rounds([gpu.run("a"), gpu.run("b")], per_run=1, rounds=3)
    assert len(gpu.sleeps) == autotune.MAX_SLEEP_DOUBLINGS + 1


def test_single_calls_break_a_tie_under_graph_replay(monkeypatch):
    timed = []

    def single_calls(calls, per_run, rounds, pause_cycles):
        timed.append([call() for call in calls])
        return [[5.0] * 10, [4.0] * 10, [4.0] * 10][:len(calls)]
    monkeypatch.setattr(autotune, "_time_rounds", single_calls)
    calls = [lambda i=i: i for i in range(4)]
    tie = 1 + autotune.GRAPH_TIE / 2
    # 0, 1 and 3 tie; 3 is as fast as 1 as a single call and slower under graph replay.
    assert autotune._fastest(calls, [1.0, tie, 1.5, tie * 1.001]) == (1, {0: 5.0, 1: 4.0,
                                                                         3: 4.0})
    assert timed == [[0, 1, 3]]
    # One clear winner: no single calls are timed.
    assert autotune._fastest(calls, [1.0, 1.5, 1.5, 1.5]) == (0, {}) and len(timed) == 1


def test_a_tie_goes_to_the_lower_trimmed_mean_not_the_lower_median(monkeypatch):
    # Single calls fall at two levels: 0 is at the lower one more often than not (the lower
    # median), 1 always just above it (the lower trimmed mean); 2 is level with 1 but for two
    # stalls, one at each end, which the trim drops.
    samples = [[4.0] * 6 + [4.2] * 4, [4.03] * 10, [1.0] + [4.03] * 8 + [50.0]]
    monkeypatch.setattr(autotune, "_time_rounds", lambda calls, *args: samples)
    best, single_us = autotune._fastest([lambda: None] * 3, [1.0, 1.0, 1.001])
    assert best == 1 and single_us == pytest.approx({0: 4.075, 1: 4.03, 2: 4.03})


def test_a_tie_goes_to_the_candidate_that_gives_up_least_in_either_mode(monkeypatch):
    singles = []
    monkeypatch.setattr(autotune, "_time_rounds",
                        lambda calls, *args: [[us] * 5 for us in singles[-1]])
    calls = [lambda: None] * 3

    def winner(graph_us, single_us):
        singles.append(single_us)
        return autotune._fastest(calls, graph_us)[0]
    # 1 is 0.5% faster as a single call but 1.2% slower under graph replay: 0 wins.
    assert winner([1.0, 1.012, 1.5], [4.02, 4.0]) == 0
    # 1 is 5% faster as a single call: it wins despite graph replay's 1.2%.
    assert winner([1.0, 1.012, 1.5], [4.2, 4.0]) == 1
    # Level on the larger ratio: the faster under graph replay wins.
    assert winner([1.0, 1.01, 1.01], [4.04, 4.0, 4.0]) == 0
    # Beside a neighbour a single call less its time can read 0 or less: the lowest wins.
    assert winner([1.0, 1.01, 1.5], [0.5, -0.1]) == 1


def test_beside_a_neighbour_its_time_in_the_same_round_is_taken_off(monkeypatch):
    timed = []

    def rounds(runs, per_run, rounds_, pause_cycles=0):
        timed.append(runs)
        return [[5.0, 9.0], [6.0, 8.5], [1.0, 4.0]][:len(runs)]  # the neighbour's last
    monkeypatch.setattr(autotune, "_time_rounds", rounds)
    neighbour = object()
    assert autotune._time_less(["a", "b"], neighbour, 20, 2) == [[4.0, 5.0], [5.0, 4.5]]
    assert timed[-1] == ["a", "b", neighbour]
    assert autotune._time_less(["a", "b"], None, 20, 2) == [[5.0, 9.0], [6.0, 8.5]]
    # A tie broken by single calls takes off the neighbour's single call, timed with them.
    assert autotune._fastest([lambda: 0, lambda: 1], [1.0, 1.0], neighbour) == (
        0, {0: 4.5, 1: 4.75})  # the means of (4, 5) and (5, 4.5)
    assert timed[-1][-1] is neighbour


def test_trimmed_mean_checks_its_arguments():
    assert timing.trimmed_mean([1.0, 2.0, 3.0, 100.0], cut=0.25) == 2.5
    assert timing.trimmed_mean([7.0]) == 7.0
    for samples, cut in (([], 0.1), ([1.0], 0.5), ([1.0], -0.1)):
        with pytest.raises(ValueError, match="trimmed_mean: needs samples"):
            timing.trimmed_mean(samples, cut)


WRITER = textwrap.dedent("""
    import sys
    from jitk import autotune
    name = sys.argv[1]
    env = autotune.environment()
    for i in range(int(sys.argv[2])):
        autotune.record([{"op": "jitk_tune::copy", "bucket": [name, i], "environment": env,
                          "config": {"threads": 128, "unroll": 1}}])
""")


def test_two_processes_recording_at_once_lose_no_entry(fresh_file):
    count = 25
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, name, str(count)])
               for name in ("a", "b")]
    for writer in writers:
        assert writer.wait(timeout=120) == 0
    entries = json.loads(fresh_file.read_text())["entries"]
    assert sorted(tuple(e["bucket"]) for e in entries) == sorted(
        (name, i) for name in ("a", "b") for i in range(count))


@pytest.mark.gpu
def test_tuning_rmsnorm_records_a_checked_winner_that_another_process_uses(fresh_file):
    import jitk.kernels.norm  # noqa: F401 - registers the operator

    info = jitk.runtime.op.find_op("jitk::rmsnorm")
    args, kwargs = info.tuning.sample_calls((16, 4096), torch.bfloat16, torch.device("cuda"))[0]
    bucket = info.tuning.bucket(*args, **kwargs)
    result = autotune.tune(info, args, kwargs)
    assert not result.failures and result.config in info.tuning.candidates(bucket)
    fastest = min(us for _, us in result.timings if us is not None)
    assert fastest <= result.us <= fastest * (1 + autotune.GRAPH_TIE)  # single calls break ties
    script = ("import torch, jitk.kernels.norm, jitk\n"
              "space = jitk.runtime.op.find_op('jitk::rmsnorm').tuning\n"
              f"print(sorted(space.config((4096, torch.bfloat16, {bucket[2]})).items()))\n")
    reused = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, check=True)
    assert reused.stdout.strip() == str(sorted(result.config.items()))  # the file's order


@pytest.mark.gpu
def test_tuning_fused_add_rmsnorm_beside_a_gemm_tries_pdl_off_and_records_the_setting(
        fresh_file):
    import jitk.kernels.norm  # noqa: F401 - registers the operator

    info = jitk.runtime.op.find_op("jitk::fused_add_rmsnorm")
    args, kwargs = info.tuning.sample_calls((16, 4096), torch.bfloat16, torch.device("cuda"))[0]
    bucket = info.tuning.bucket(*args, **kwargs)
    result = autotune.tune(info, args, kwargs, beside=True)
    tried = [config for config, us in result.timings if us is not None]
    assert result.beside and not result.failures
    # beside a GEMM, each choice is tried with PDL off too
    assert len(tried) == len(info.tuning.candidates(bucket, beside=True)) == 2 * len(
        info.tuning.candidates(bucket))
    assert {config["pdl"] for config in tried} == {True, False}
    fastest = min(us for _, us in result.timings)
    assert fastest <= result.us <= fastest * (1 + autotune.GRAPH_TIE)  # single calls break ties
    assert 0 < result.us < 50  # the GEMM's time is taken off: a 16x4096 norm's microseconds
    (entry,) = json.loads(fresh_file.read_text())["entries"]
    assert entry["beside"] is True and entry["config"] == result.config


@pytest.mark.gpu
@pytest.mark.parametrize("direction", [1, 2])  # load-back, write-back
def test_tuning_a_hicache_transfer_checks_every_candidate_and_the_call_runs_the_winner(
        fresh_file, direction):
    from jitk.kernels import hicache

    info = jitk.runtime.op.find_op("jitk::transfer_hicache_one_layer")
    args, kwargs = info.tuning.sample((1024, 1024, direction), torch.bfloat16,
                                      torch.device("cuda"))
    bucket = info.tuning.bucket(*args, **kwargs)
    result = autotune.tune(info, args, kwargs, rounds=3)
    assert not result.failures and result.config in info.tuning.candidates(bucket)
    assert info.tuning.config(bucket) == result.config  # recorded, and what lookups find
    dst, indices_dst, src, indices_src = args[0], args[2].cpu(), args[3], args[5].cpu()
    torch.cuda.synchronize()  # the tuner's last runs may still write dst
    dst.fill_(float("nan"))
    hicache.transfer_hicache_one_layer(*args, **kwargs)
    torch.cuda.synchronize()  # a write-back's dst is host memory: .cpu() would not wait
    torch.testing.assert_close(dst.cpu()[indices_dst], src.cpu()[indices_src], rtol=0, atol=0)
