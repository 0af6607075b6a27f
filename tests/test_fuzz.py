"""Every fuzz target (``tests/fuzz/``) over its committed seed corpus, then a fixed number of
mutations from a fixed seed (``-seed=1 -runs=N``): a regression of any parser a peer or a disk
feeds fails here. A few seconds a target, all of them together well under two minutes; long
runs are ``make fuzz FUZZ_SECONDS=... [FUZZ_TARGET=...]``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fuzz"))

import run as fuzz

RUNS = {
    "config": 400,
    "grpc_requests": 1500,
    "local_call": 1500,
    "nvme_records": 2000,
    "nvme_superblock": 150,
    "redis_value": 20000,
    "resp": 5000,
    "session_op": 5000,
}
"""Mutations per target: about two seconds of each one's rate, after its seed corpus."""


def test_every_target_has_a_seed_corpus_and_a_budget() -> None:
    for name in fuzz.targets():
        assert name in RUNS, f"tests/fuzz/fuzz_{name}.py has no run budget here"
        assert name in fuzz.MAX_LEN, f"tests/fuzz/fuzz_{name}.py has no -max_len in run.py"
        seeds = list((fuzz.CORPUS / name).iterdir())
        assert seeds, f"no seed corpus for {name}: run tests/fuzz/make_corpus.py {name}"
    total = sum(p.stat().st_size for p in fuzz.CORPUS.rglob("*") if p.is_file())
    assert total < 512 << 10, f"the seed corpora take {total} bytes"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_fuzz_target_finds_no_crash(name: str, tmp_path: Path) -> None:
    result = fuzz.run_target(name, runs=RUNS[name], seed=1, crashes=tmp_path)
    assert result.crash is None, f"{name} crashed ({result.crash}):\n{result.output[-8000:]}"
    assert result.executed >= RUNS[name], f"{name} ran {result.executed} inputs"
