"""glm5f/run/trackers.py: one GRPO run reporting to TensorBoard, W&B (offline: no login) and MLflow (a local
store), each read back with the tracker's own reader: every metrics.jsonl number at its step, the config as
hyperparameters, the sampled completions (also in completions.jsonl, checked against the rollouts file)."""

import glob
import importlib.util
import json
import struct

import pytest

from conftest import cli
from configs import validate
from glm5f.data.tokens import ChatByteTokenizer
from glm5f.run.metrics import read_metrics
from glm5f.run.trackers import TRACKERS, scalars
from test_grpo import rollout_records
from train import train

INSTALLED = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def installed(tracker: str) -> bool:
    return importlib.util.find_spec(INSTALLED[tracker]) is not None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run directory, its metrics records, the rollouts records): 2 GRPO steps of glm5-tiny over a rollouts file,
    reporting to every installed tracker, 2 completions a step; no W&B login (HOME without a netrc)."""
    on = [t for t in TRACKERS if installed(t)]
    if not on:
        pytest.skip("none of tensorboard, wandb, mlflow is installed")
    tmp = tmp_path_factory.mktemp("trackers")
    mp = pytest.MonkeyPatch()
    for name in ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI"):
        mp.delenv(name, raising=False)
    mp.setenv("HOME", str(tmp))
    recs = rollout_records(256, groups=4, size=2, seed=3)
    (tmp / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    run_dir = tmp / "run"
    try:
        records = train(cli("--train.objective", "grpo", "--data.type", "rollouts", "--data.path", str(tmp / "r.jsonl"),
                            "--data.batch_size", "2", "--data.seq_len", "32", "--train.steps", "2", "--eval.every", "0",
                            "--optim.warmup_steps", "0", "--metrics.report_to", ",".join(on),
                            "--metrics.log_completions", "2", "--checkpoint.dir", str(run_dir)))
    finally:
        mp.undo()
    assert read_metrics(str(run_dir)) == json.loads(json.dumps(records))
    return run_dir, records, recs


def need(tracker: str) -> None:
    if not installed(tracker):
        pytest.skip(f"{tracker} is not installed (pip install {tracker})")


def test_completions_jsonl_holds_the_batch_s_completions(run):
    run_dir, records, recs = run
    tok = ChatByteTokenizer()
    rows = read_metrics(str(run_dir / "completions.jsonl"))
    assert [r["step"] for r in rows] == [1, 1, 2, 2]
    known = {(tok.decode(rec["prompt_ids"]), tok.decode(c["ids"]), c["reward"], len(c["ids"]))
             for rec in recs for c in rec["completions"]}
    assert all((r["prompt"], r["completion"], r["reward"], r["length"]) in known for r in rows), rows


def test_tensorboard_event_files_hold_every_number_and_the_config(run):
    need("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    run_dir, records, _ = run
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    for rec in records:
        for k, v in scalars(rec).items():
            got = {e.step: e.value for e in acc.Scalars(k)}[rec["step"]]
            assert got == struct.unpack("f", struct.pack("f", v))[0], (k, got, v)  # stored as fp32
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hp = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hp["optim.lr"].number_value == 3e-3 and hp["train.objective"].string_value == "grpo"
    text = acc.Tensors("completions/text_summary")
    assert [e.step for e in text] == [1, 2]
    first = read_metrics(str(run_dir / "completions.jsonl"))[0]
    assert f"| {first['reward']} | {first['length']} |" in text[0].tensor_proto.string_val[0].decode()


def wandb_records(path: str) -> list:
    """The protobuf Records of a W&B run file (.wandb): W&B's LevelDB-style log (a 7-byte file header, 32 KiB
    blocks of records each with a 7-byte header: checksum, length, type full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    out, pos, parts = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # padding to the block's end
            pos += left
            continue
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or the last part
            out.append(wandb_internal_pb2.Record.FromString(parts))
            parts = b""
    return out


def test_wandb_offline_run_files_hold_every_number_and_the_config(run):
    need("wandb")
    run_dir, records, _ = run
    files = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(files) == 1, files  # offline: no login
    history, config = {}, {}
    for r in wandb_records(files[0]):
        if r.HasField("history"):
            step = history.setdefault(r.history.step.num, {})
            for i in r.history.item:
                *outer, last = [i.key] if i.key else list(i.nested_key)
                (step.setdefault(outer[0], {}) if outer else step)[last] = json.loads(i.value_json)
        elif r.HasField("run") or r.HasField("config"):
            update = r.run.config.update if r.HasField("run") else r.config.update
            config.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in update})
    for rec in records:
        for k, v in scalars(rec).items():
            assert history[rec["step"]][k] == v, (k, history[rec["step"]][k], v)
    lr = config["optim.lr"]
    assert (lr["value"] if isinstance(lr, dict) else lr) == 3e-3
    table = history[2]["completions"]
    tables = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "files" / table["path"]))
    written = json.loads(open(tables[0]).read())
    rows = [r for r in read_metrics(str(run_dir / "completions.jsonl")) if r["step"] == 2]
    assert written["columns"] == ["prompt", "completion", "reward", "length"]
    assert written["data"] == [[r[c] for c in written["columns"]] for r in rows]


def test_mlflow_file_store_holds_every_number_and_the_config(run, tmp_path):
    need("mlflow")
    from mlflow.tracking import MlflowClient

    run_dir, records, _ = run
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("glm5f").experiment_id])
    assert found.info.status == "FINISHED" and found.data.params["optim.lr"] == "0.003"
    for k in scalars(records[0]):
        history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, k)}
        assert history == {rec["step"]: scalars(rec)[k] for rec in records}, k
    local = client.download_artifacts(found.info.run_id, "completions/step_00000002.jsonl", str(tmp_path))
    rows = [r for r in read_metrics(str(run_dir / "completions.jsonl")) if r["step"] == 2]
    assert [json.loads(line) for line in open(local)] == [{k: r[k] for k in r if k != "step"} for r in rows]


def test_an_unknown_tracker_is_refused():
    assert any("--metrics.report_to takes tensorboard, wandb, mlflow (comma-separated), found 'tensorbord'" in e
               for e in validate(cli("--metrics.report_to", "tensorbord")))
