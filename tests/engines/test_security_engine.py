"""Engines are not a way into the machine.

* They bind 127.0.0.1 unless told otherwise, and refuse any other address without an API key.
* Nothing received over the network is unpickled: the modules on the network path contain
  no unpickling call, every `torch.load` in the package is `weights_only=True` (save two
  reviewed local-pipe uses), and a pickled payload sent to /update_weights_from_tensor is a
  4xx that never runs (its __reduce__ would create a marker file).
* Weights arrive as raw tensors whose names, dtypes and shapes are checked against the model:
  a wrong one, a handle pointing outside /dev/shm, a truncated bucket or a missing API key
  is a 4xx and the engine's weights and version are unchanged; the same update done right
  is accepted (so the refusals are not an engine that refuses everything).
"""

from __future__ import annotations

import ast
import base64
import json
import pickle
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

import dapo_mega
from dapo_mega.config import RolloutConfig
from dapo_mega.engines.fleet import EngineFleet
from dapo_mega.wire import transport

API_KEY = "sec-key"
PACKAGE = Path(dapo_mega.__file__).resolve().parent
EMBEDDED_ENGINE_MODULES = sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "engines/embedded").glob("*.py"))
"""Every module of the embedded engine (`engines/embedded/`): it serves HTTP."""
NETWORK_MODULES = [*EMBEDDED_ENGINE_MODULES, "engines/sglang/client.py", "rollout/manager.py",
                   "wire/transport.py", "weights/sync.py", "engines/sglang/api.py", "engines/sglang/commands.py",
                   "engines/sglang/endpoint.py", "engines/fleet.py", "engines/process.py"]
# Reviewed exceptions: local pipes/queues between this package's own processes, no network.
LOCAL_UNPICKLING = {
    ("reward/worker.py", "pickle.loads"): "the verifier, from the parent over an inherited pipe",
    ("weights/spawn.py", "torch.load"): "a spawned conversion rank's return value, over a local queue",
}
NAME = "model.layers.0.mlp.down_proj.weight"


UNPICKLERS = {"pickle.load", "pickle.loads", "pickle.Unpickler", "torch.load", "marshal.load", "marshal.loads",
              "ForkingPickler.loads", "dill.loads", "cloudpickle.loads", "numpy.load", "np.load"}


def _unpickling_calls(path: Path):
    """(callee, its weights_only= value or None) of every call that can unpickle."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func) in UNPICKLERS:
            weights_only = next((ast.literal_eval(k.value) for k in node.keywords if k.arg == "weights_only"), None)
            found.append((ast.unparse(node.func), weights_only))
    return found


def test_no_unpickling_on_the_network_path_and_torch_load_is_weights_only():
    assert "engines/embedded/server.py" in EMBEDDED_ENGINE_MODULES, EMBEDDED_ENGINE_MODULES
    for rel in NETWORK_MODULES:
        text = (PACKAGE / rel).read_text()
        assert "import pickle" not in text and "pickle.load" not in text, rel
        assert "torch.load" not in text and "weights_only=False" not in text, rel
        assert _unpickling_calls(PACKAGE / rel) == [], rel
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        for dotted, weights_only in _unpickling_calls(path):
            if (rel, dotted) in LOCAL_UNPICKLING:
                continue
            if dotted == "torch.load":
                assert weights_only is True, f"{rel}: torch.load without weights_only=True"
            else:
                pytest.fail(f"{rel}: {dotted} can unpickle; only reviewed local uses may")


def test_engines_bind_loopback_by_default_and_refuse_other_hosts_without_key(tmp_path):
    from dapo_mega.config import RolloutConfig
    from dapo_mega.engines.embedded.server import build_arg_parser, main
    from dapo_mega.engines.sglang.commands import build_engine_command

    assert RolloutConfig().host == "127.0.0.1"
    assert build_arg_parser().parse_args(["--model-path", "m"]).host == "127.0.0.1"
    with pytest.raises(SystemExit, match="bind to 0.0.0.0 without an API key"):
        main(["--model-path", str(tmp_path / "no_model"), "--host", "0.0.0.0"])  # before any model load
    with pytest.raises(ValueError, match="rollout.api_key"):
        build_engine_command(RolloutConfig(backend="sglang", host="0.0.0.0"), "m", 30000)
    argv = build_engine_command(RolloutConfig(backend="sglang", host="0.0.0.0", api_key="k"), "m", 30000)
    assert argv[argv.index("--api-key") + 1] == "k"


# --------------------------------------------------------------------------- a live engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from dapo_mega.models.tiny import build_tiny_model_dir

    model_dir = tmp_path_factory.mktemp("sec_model")
    build_tiny_model_dir(model_dir, seed=11)
    with EngineFleet(RolloutConfig(api_key=API_KEY), str(model_dir), tmp_path_factory.mktemp("sec_log"),
                     weight_version="3") as fleet:
        fleet.start(1)
        # updates run inside a weight-update session (as SGLang requires); the tests here
        # are about what an update inside one may carry
        assert call(fleet.engines[0], "/begin_weight_update", {})[0] == 200
        yield fleet.engines[0]


def call(engine, path, body=None, key=API_KEY, raw=None, content_type="application/json"):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(engine.url + path, data=data, method="POST" if data is not None else "GET")
    req.add_header("Content-Type", content_type)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as err:
        text = err.read().decode()
        try:
            return err.code, json.loads(text)
        except ValueError:
            return err.code, text


def weight(engine, name=NAME):
    status, rows = call(engine, "/get_weights_by_name", {"name": name, "truncate_size": 10**6})
    assert status == 200
    return torch.tensor(rows)


def version(engine):
    return call(engine, "/model_info")[1]["weight_version"]


def test_engine_listens_on_loopback_only(engine):
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:] if Path("/proc/net/tcp").exists() else []
    if not rows:
        pytest.skip("no /proc/net/tcp")
    listening = [r.split()[1] for r in rows if r.split()[3] == "0A" and int(r.split()[1].split(":")[1], 16) == engine.port]
    assert listening == ["0100007F:%04X" % engine.port]  # 127.0.0.1, little-endian hex


class _Marker:
    """Unpickling this creates a file: proof of code execution."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _tensor_update(entry, load_format="shared_memory_json", version_="evil"):
    return {"serialized_named_tensors": [entry], "load_format": load_format, "weight_version": version_}


def test_pickled_payloads_are_refused_unexecuted(engine, tmp_path):
    marker = tmp_path / "unpickled"
    payload = base64.b64encode(pickle.dumps([(_Marker(marker), torch.zeros(1))])).decode()
    before, v = weight(engine), version(engine)
    for body in (_tensor_update(payload, load_format=None), _tensor_update(payload)):  # SGLang's format, ours
        status, reply = call(engine, "/update_weights_from_tensor", body)
        assert status == 400 and reply["success"] is False, reply
    status, _ = call(engine, "/update_weights_from_tensor", raw=pickle.dumps(_Marker(marker)),
                     content_type="application/octet-stream")
    assert status == 400
    assert not marker.exists(), "a received payload was unpickled"
    assert torch.equal(weight(engine), before) and version(engine) == v


def _shm_update(tensors):
    handle = transport.write_shm_bucket(tensors)
    return handle, base64.b64encode(json.dumps(handle).encode()).decode()


def test_weight_updates_are_checked_raw_tensors(engine, tmp_path):
    before, v = weight(engine), version(engine)
    shape = list(before.shape)
    handles = []
    try:
        cases = {  # what goes wrong -> the words the 400 must contain
            "unknown name": ([("model.layers.0.mlp.nope.weight", torch.zeros(shape))], "model.layers.0.mlp.nope.weight"),
            "wrong shape": ([(NAME, torch.zeros(shape[0], shape[1] + 1))], "shape"),
            "integer dtype": ([(NAME, torch.zeros(shape, dtype=torch.int32))], "floating-point"),
        }
        for what, (tensors, words) in cases.items():
            handle, entry = _shm_update(tensors)
            handles.append(handle)
            status, reply = call(engine, "/update_weights_from_tensor", _tensor_update(entry))
            assert status == 400 and words in reply["message"], (what, reply)

        good, entry = _shm_update([(NAME, before + 1.0)])
        handles.append(good)
        # a file outside /dev/shm (and not one of ours) is never mapped
        outside = tmp_path / Path(good["path"]).name
        outside.write_bytes(Path(good["path"]).read_bytes())
        for path in (str(outside), "/etc/passwd", str(Path(good["path"]).parent / ".." / "etc" / "passwd")):
            forged = base64.b64encode(json.dumps({**good, "path": path}).encode()).decode()
            status, reply = call(engine, "/update_weights_from_tensor", _tensor_update(forged))
            assert status == 400 and "is not a" in reply["message"], (path, reply)
        # a bucket shorter than its handle says
        short, _ = _shm_update([(NAME, before + 1.0)])
        handles.append(short)
        Path(short["path"]).write_bytes(Path(short["path"]).read_bytes()[:100])
        status, reply = call(engine, "/update_weights_from_tensor",
                             _tensor_update(base64.b64encode(json.dumps(short).encode()).decode()))
        assert status == 400 and "bytes" in reply["message"], reply
        # the right update without the key, or with a wrong one
        for key in (None, "wrong"):
            status, _ = call(engine, "/update_weights_from_tensor", _tensor_update(entry), key=key)
            assert status == 401
        status, reply = call(engine, "/update_weights_from_distributed",
                             {"names": NAME, "dtypes": "float32", "shapes": shape})
        assert status == 400 and "must be lists" in reply["message"]
        assert torch.equal(weight(engine), before) and version(engine) == v

        status, reply = call(engine, "/update_weights_from_tensor", _tensor_update(entry, version_="4"))
        assert status == 200 and reply["success"] is True, reply
        assert torch.equal(weight(engine), before + 1.0) and version(engine) == "4"
        restore, entry = _shm_update([(NAME, before)])
        handles.append(restore)
        assert call(engine, "/update_weights_from_tensor", _tensor_update(entry, version_=v))[0] == 200
        assert torch.equal(weight(engine), before)
    finally:
        for handle in handles:
            transport.remove_shm_bucket(handle)
