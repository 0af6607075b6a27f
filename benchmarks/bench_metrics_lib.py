"""The daemon's hand-written RPC histogram and exposition against ``prometheus_client``.

``kvstore.daemon.metrics`` keeps its own histogram and text exposition; this measures what the
library would cost instead, on the daemon's event loop: one ``observe`` per call (the
hand-written ``RpcMetrics.observe``; the library's ``labels(m).observe`` and a bound child's
``observe``) and one scrape (``render_metrics`` of the RPC figures and every family header; the
library's ``generate_latest`` of the RPC histogram alone). Medians of 5 runs of the best of 3.

``prometheus_client`` is not a dependency of kvstore, only of its dev extra (as the peer
measured here); without it the script says so and exits 77 (skipped).

``--smoke``: 200 observations a run; checks the script runs (the test suite runs it so).
"""

from __future__ import annotations

import statistics
import sys
import timeit
from collections.abc import Callable

import grpc
from _harness import Reporter, emit, parse_args, print_header, run_main, skip

from kvstore.daemon.metrics import RPC_BUCKETS_S, RpcMetrics, render_metrics
from kvstore.v1 import kvstore_pb2 as pb

METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods]


def per_call_us(fn: Callable[[], object], number: int) -> float:
    runs = [min(timeit.repeat(fn, number=number, repeat=3)) / number * 1e6 for _ in range(5)]
    return statistics.median(runs)


def main() -> int:
    args = parse_args(__doc__.split("\n\n")[0])
    rep = Reporter(args.json)
    if not args.json:
        print_header("bench_metrics_lib", args)
    try:
        from prometheus_client import CollectorRegistry, Histogram, generate_latest
    except ImportError:
        return skip(args, "module:prometheus_client", "pip install prometheus_client")
    ours = RpcMetrics(METHODS)
    registry = CollectorRegistry()
    hist = Histogram(
        "kvstore_rpc_duration_seconds", "RPC time", ["method"], buckets=RPC_BUCKETS_S,
        registry=registry,
    )  # fmt: skip
    for m in METHODS:
        hist.labels(m)
    child = hist.labels("Lookup")
    n = 200 if args.smoke else 2000 if args.quick else 20000
    us = {
        "observe_ours": per_call_us(lambda: ours.observe("Lookup", 3e-4, grpc.StatusCode.OK), n),
        "observe_lib_labels": per_call_us(lambda: hist.labels("Lookup").observe(3e-4), n),
        "observe_lib_child": per_call_us(lambda: child.observe(3e-4), n),
        "render_ours": per_call_us(
            lambda: render_metrics(None, ours, version="x", uptime_s=1.0), n // 100
        ),
        "render_lib": per_call_us(lambda: generate_latest(registry), n // 100),
    }
    rep.table(
        "Cost on the daemon's loop (us, median of 5)",
        ["what", "hand-written", "prometheus_client"],
        [
            ["observe one call", us["observe_ours"], us["observe_lib_labels"]],
            ["observe, bound child", "", us["observe_lib_child"]],
            ["render a scrape", us["render_ours"], us["render_lib"]],
        ],
    )
    emit({"us": us}, args)
    return 0


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[attr-defined]
    run_main(main)
