"""The checks before a run or a script allocates anything (glm5f/run/preflight.py): train.py refuses, in one line and
before any process starts, a run past the memory available or the cores, or one whose files are missing; the
scripts refuse weights that do not fit; the figures are the bytes the real tensors take."""

import os
import resource
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import glm5f
import train
from conftest import write_records
from glm5f.run import preflight
from glm5f.ckpt import checkpoint
from glm5f.model.decode import init_cache
from glm5f.train.optim import trained_paths
from glm5f.core.params import flatten
from glm5f.run.plan import GB
from scripts import convert, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model.preset", "glm5-tiny", "--data.type", "synthetic", "--data.batch_size", "2", "--data.seq_len", "32",
        "--eval.every", "0", "--optim.warmup_steps", "1"]


@pytest.fixture
def started(monkeypatch):
    """What train.py's main started: ("train", cfg) for a one-process run, ("spawn", world) for workers; neither
    runs (a run the check failed to refuse would otherwise allocate what does not fit)."""
    calls = []
    monkeypatch.setattr(train, "train", lambda cfg, layout=None: calls.append(("train", cfg)))
    monkeypatch.setattr(train, "spawn", lambda fn, world, argv: calls.append(("spawn", world)))
    return calls


def available(monkeypatch, gb: float) -> None:
    monkeypatch.setattr(preflight, "host_available", lambda: (int(gb * GB), "a test's figure"))


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_glm53_stops_at_once_naming_the_memory_it_needs(tmp_path):
    """The GLM-5.3 preset (313B parameters: 6.27 TB with AdamW in fp32) in one process: one error line with the
    figure, before anything is allocated (the process may not even map 8 GB) or written."""
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # noqa: E731
    proc = subprocess.run([sys.executable, "train.py", "--model.preset", "glm53", "--train.steps", "1",
                           "--train.device", "cpu", "--checkpoint.dir", str(tmp_path / "run")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, preexec_fn=limit)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: this run needs at least 6,265.2"), lines
    assert "--train.skip_memory_check" in lines[0] and "--plan search" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags,what", [(["--data.seq_len", "100000000"], "--data.seq_len"),
                                        (["--model.hidden_size", "1000000"], "--lora.rank")])
def test_a_run_past_the_memory_available_is_refused(tmp_path, capsys, monkeypatch, started, flags, what):
    """100M-token sequences (1.28 TB of activations the layers keep) or a hidden size of 10^6 (72 GB of state) on
    a machine with 24 GB available: refused with what to change, nothing started."""
    available(monkeypatch, 24)
    assert train.main([*flags, "--checkpoint.dir", str(tmp_path / "run")]) == 1
    line = error_line(capsys)
    assert line.startswith("error: this run needs at least") and what in line and started == []


def test_a_smaller_available_figure_refuses_the_default_run_and_the_flag_lets_it_through(tmp_path, capsys,
                                                                                          monkeypatch, started):
    """The default run's need is its plan's update phase (AdamW: the params, and for the trained leaves two
    moments, gradients and one update copy) or its forward/backward with the layer inputs and rope tables:
    against 1 MB available it is refused, saying both figures; --train.skip_memory_check starts it."""
    available(monkeypatch, 0.001)
    args = ["--checkpoint.dir", str(tmp_path / "run")]
    assert train.main(args) == 1
    line = error_line(capsys)
    cfg = glm5f.preset("glm5-tiny")
    params = glm5f.init_params(cfg)
    trained = sum(flatten(params)[p].nbytes for p in trained_paths(params))
    update = sum(t.nbytes for t in flatten(params).values()) + 4 * trained  # + grads, mu, nu, one update copy
    # each layer's input [16, 128, 64] and the rope tables' cos and sin [16, 128, 8 / 2], fp32
    kept = 16 * 128 * (cfg.num_hidden_layers * cfg.hidden_size + 2 * cfg.qk_rope_head_dim // 2) * 4
    # the update phase, or params, moments and the activations in the backward (no gathered copies in one process)
    need = max(update, update - 2 * trained + kept)
    config = train.parse(args)
    assert preflight.run_need(config, cfg, 1, False)[0] == need
    assert line.startswith(f"error: this run needs at least {need / 1e6:.1f} MB ({update / 1e6:.1f} MB of "
                           f"parameters, gradients and optimizer state in the update, {kept / 1e6:.1f} MB of "
                           f"activations every layer keeps for the backward), but cpu has 1.0 MB available (a test's "
                           f"figure)"), line
    assert started == []
    assert train.main([*args, "--train.skip_memory_check"]) == 0 and [s[0] for s in started] == ["train"]


def test_the_128_rank_recipe_reports_its_missing_data_before_a_worker_starts(tmp_path, capsys, started):
    assert train.main(["--config", os.path.join(ROOT, "recipes", "glm5-muon-sft.yaml"),
                       "--checkpoint.dir", str(tmp_path / "run")]) == 1
    assert error_line(capsys) == ("error: --data.path 'data/sft.jsonl': no such file (expected a JSONL file, one "
                                  "record per line)")
    assert started == [] and not (tmp_path / "run").exists()


def test_the_128_rank_recipe_is_refused_for_memory_and_for_cores(tmp_path, capsys, monkeypatch, started):
    """With its data there, on a machine of 64 cores: its 128 local ranks of 74 GB each (the plan says 83 GB) are
    refused against 500 GB; on 2 cores the 128 processes are refused first; neither starts a worker."""
    data = write_records(tmp_path / "sft.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": "hello"}]}])
    args = ["--config", os.path.join(ROOT, "recipes", "glm5-muon-sft.yaml"), "--data.path", data,
            "--checkpoint.dir", str(tmp_path / "run")]
    available(monkeypatch, 500)
    monkeypatch.setattr(preflight, "usable_cores", lambda: 64)
    assert train.main(args) == 1
    line = error_line(capsys)
    assert line.startswith("error: the 128 local ranks need at least") and "74.01 GB of parameters" in line
    monkeypatch.setattr(preflight, "usable_cores", lambda: 2)
    assert train.main(args) == 1
    assert "128 processes on this machine, which has 2 CPU core(s)" in error_line(capsys)
    assert started == []


def test_local_processes_past_eight_a_core_are_refused_unless_the_flag_says(tmp_path, capsys, monkeypatch, started):
    """Cores alone decide here: the memory this machine has and this process holds are fixed by the test."""
    monkeypatch.setattr(preflight, "usable_cores", lambda: 2)
    monkeypatch.setattr(preflight, "process_rss_bytes", lambda field="VmRSS": GB // 2)
    available(monkeypatch, 64)
    args = [*TINY, "--parallel.dp_shard", "32", "--data.batch_size", "32", "--checkpoint.dir", str(tmp_path / "r")]
    assert train.main(args) == 1
    assert "32 processes on this machine, which has 2 CPU core(s)" in error_line(capsys)
    assert train.main([*args[:-2], "--parallel.dp_shard", "16", "--data.batch_size", "16",
                       "--checkpoint.dir", str(tmp_path / "r16")]) == 0  # 8 a core
    assert train.main([*args, "--train.skip_memory_check"]) == 0 and started == [("spawn", 16), ("spawn", 32)]


def test_spawned_ranks_each_count_this_processs_runtime(tmp_path, capsys, monkeypatch, started):
    """Two spawned CPU ranks need twice (their plan's lower bound + this process's resident memory); under
    torchrun the processes exist already and count their LOCAL_WORLD_SIZE without a runtime."""
    monkeypatch.setattr(preflight, "process_rss_bytes", lambda field="VmRSS": 10 * GB)
    available(monkeypatch, 15)
    args = [*TINY, "--parallel.dp_shard", "2", "--checkpoint.dir", str(tmp_path / "run")]
    assert train.main(args) == 1
    line = error_line(capsys)
    assert "the 2 local ranks need at least 20.0" in line and "10.00 GB of runtime a process" in line
    available(monkeypatch, 17)  # 20 GB within 1.25 x 17
    assert train.main(args) == 0 and started == [("spawn", 2)]


def test_on_a_gpu_one_ranks_need_counts_against_its_own_gpu(monkeypatch):
    """On a GPU each local rank has its own: one rank's need (no runtime: it is not host memory) against the free
    memory of the GPU of this local rank (torchrun's LOCAL_RANK), or for spawned ranks against cuda:0's total
    (the launcher does not open the GPU its rank 0 will use)."""
    cfg = train.parse(["--model.preset", "glm5-tiny"])
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: asked.append(device) or (10**6, 80 * GB))
    with pytest.raises(ValueError, match=r"^this run needs at least 5\.0 MB .*, but cuda:1 has 1\.0 MB available "
                                         r"\(free memory of cuda:1"):
        preflight.check_run(cfg, torch.device("cuda"), 4, spawned=False, rank=1)
    assert asked == [torch.device("cuda", 1)]
    total = lambda device: SimpleNamespace(total_memory=10**6 if device.index == 0 else 80 * GB)  # noqa: E731
    monkeypatch.setattr(torch.cuda, "get_device_properties", total)
    with pytest.raises(ValueError, match=r"^this run needs at least 5\.0 MB .*, but cuda:0 has 1\.0 MB available "
                                         r"\(total memory of cuda:0\)"):
        preflight.check_run(cfg, torch.device("cuda"), 4, spawned=True)
    assert len(asked) == 1


def test_available_host_memory_is_the_lesser_of_meminfo_and_the_cgroup_room(tmp_path, monkeypatch):
    """MemAvailable (as /proc/meminfo says it), or under a cgroup limit the room left: limit - usage + the
    reclaimable page cache; a v1 limit of 2^63 is none."""
    meminfo = dict(line.split(":") for line in open("/proc/meminfo") if line.strip())
    found, source = preflight.host_available()
    assert abs(found - int(meminfo["MemAvailable"].split()[0]) * 1024) < 512 << 20 or "cgroup" in source
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{10 << 30}\n")
    (v2 / "memory.current").write_text(f"{6 << 30}\n")
    (v2 / "memory.stat").write_text(f"anon 5\ninactive_file {1 << 30}\nactive_file 7\n")
    monkeypatch.setattr(preflight, "CGROUP_FILES", ((str(v2 / "memory.max"), str(v2 / "memory.current"),
                                                     "inactive_file"),))
    assert preflight.cgroup_room() == 5 << 30
    assert preflight.host_available() == (5 << 30, "the room under this process's cgroup memory limit")
    (v2 / "memory.max").write_text("max\n")
    assert preflight.cgroup_room() is None
    (v2 / "memory.max").write_text(f"{(1 << 63) - 4096}\n")
    assert preflight.cgroup_room() is None


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    assert train.main([*TINY, "--train.steps", "1", "--checkpoint.dir", str(run)]) == 0
    return str(run)


def test_weight_and_cache_figures_are_the_bytes_of_the_real_tensors(tiny_run):
    cfg, dtype = preflight.checkpoint_weights(checkpoint.resolve(tiny_run))
    loaded_cfg, params = checkpoint.load_params(checkpoint.resolve(tiny_run))
    assert cfg == loaded_cfg and dtype == torch.float32
    assert preflight.weight_bytes(cfg, dtype) == sum(t.nbytes for t in flatten(params).values())
    for c in (cfg, glm5f.preset("glm53-tiny")):
        cache = init_cache(c, 2, 40, torch.bfloat16)
        assert preflight.cache_bytes(c, 2, 40, torch.bfloat16) == sum(
            t.nbytes for layer in cache.layers for t in layer.values()) > 0


def test_generate_and_convert_refuse_weights_past_the_memory_available(tiny_run, tmp_path, capsys, monkeypatch):
    cfg = glm5f.preset("glm5-tiny")
    need = preflight.weight_bytes(cfg, torch.float32) + preflight.cache_bytes(cfg, 1, 6, torch.float32)
    available(monkeypatch, need / GB / 1.25 * 0.99)
    assert generate.main([tiny_run, "--prompt", "The", "--max-tokens", "5", "--device", "cpu"]) == 1
    line = error_line(capsys)
    assert line.startswith(f"error: loading {tiny_run} and decoding needs at least {need / 1e6:.1f} MB")
    assert "--skip-memory-check" in line
    assert convert.main([tiny_run, str(tmp_path / "hf")]) == 1
    assert error_line(capsys).startswith(f"error: reading {checkpoint.resolve(tiny_run)} needs at least")
    assert not (tmp_path / "hf").exists()
    assert generate.main([tiny_run, "--prompt", "The", "--max-tokens", "5", "--device", "cpu",
                          "--skip-memory-check"]) == 0
    assert convert.main([tiny_run, str(tmp_path / "hf"), "--skip-memory-check"]) == 0
    available(monkeypatch, need / GB / 1.25 * 1.01)  # within the margin: loads
    assert generate.main([tiny_run, "--prompt", "The", "--max-tokens", "5", "--device", "cpu"]) == 0
    assert generate.main([str(tmp_path / "hf"), "--prompt", "The", "--max-tokens", "5", "--device", "cpu"]) == 0
