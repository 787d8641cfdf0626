"""``qswap bench serving --ray --hop``: what each Ray Serve layout adds to one request.

One ingress replica in each layout, each on its own local Ray cluster started by ``qswap serve
--ray``, measured alternately (A B B A) against the same single process at concurrency 1:

- ``proxy + encoder deployment`` (``--encoder-replicas 1``; the default with several ingress
  replicas): Serve's HTTP proxy, the ingress replica, and a hop to the encoder deployment for
  every encode (the multiplexed encoders);
- ``proxy, encoders in ingress`` (``--encoder-replicas 0``, the default with one replica): the
  proxy, no hop;
- ``direct ingress, encoders in ingress`` (``RAY_SERVE_ENABLE_DIRECT_INGRESS=1`` too): no proxy,
  no hop: the ingress replica answers on its own port.

Requests: ``GET /healthz`` (no model work: the proxy's share) and a search with one LoRA
encoder (the encode hop's share, with the time breakdown of the response's timings). The
differences between layouts split the added time into proxy and hop.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qswap.bench.fixtures import breakdown, index_meta, qswap_server, register, search_requests
from qswap.bench.load_options import RunDirs, warm_up
from qswap.bench.loadgen import LoadResult, Request
from qswap.bench.results import md_table
from qswap.bench.stats import interleaved, summarize

NAME = "ray-serving"
#: name -> (encoder replicas, direct ingress)
LAYOUTS: dict[str, tuple[int | None, bool]] = {
    "proxy + encoder deployment": (1, False),
    "proxy, encoders in ingress": (0, False),
    "direct ingress, encoders in ingress": (0, True),
}


def _lat(rs: list[LoadResult]) -> dict[str, Any]:
    lat = [x for r in rs for x in r.latencies_ms()]
    return {"requests": sum(r.sent for r in rs), "failed": sum(r.failed for r in rs), **summarize(lat)}


def _merged(rs: list[LoadResult]) -> LoadResult:
    return LoadResult([s for r in rs for s in r.samples], sum(r.elapsed_s for r in rs), rs[0].concurrency,
                      rs[0].stopped_by)


def run(args: argparse.Namespace) -> int:
    """``qswap bench serving --ray --hop``: every layout of :data:`LAYOUTS` against the single
    process; writes the results."""
    from qswap.bench.ray_serving import ray_server, setup
    opts, dirs, work, idx_dir, enc_root = setup(args, NAME, [("m0", "1")], "ray-hop")
    tmp = dirs.tmp
    lora_req = search_requests(work.queries, ["m0@1"])
    ping = [Request("GET", "/healthz")]
    rounds = max(2, opts.rounds)
    res: dict[str, Any] = {"workload": work.source, "index": index_meta(idx_dir), "model": args.model,
                           "seconds_per_run": opts.seconds, "rounds": rounds, "layouts": {}}
    single = qswap_server(idx_dir, enc_root, tmp / "single-state", tmp / "single.log", model=args.model)
    with single:
        register(single, "m0-1")
        warm_up(single.port, lora_req, concurrency=1, requests=32)
        for i, (name, (enc_replicas, direct)) in enumerate(LAYOUTS.items()):
            srv = ray_server(idx_dir, enc_root, tmp / f"hop{i}-state", tmp / f"hop{i}.log", model=args.model,
                             replicas=1, max_encoders=4, encoder_replicas=enc_replicas, direct=direct)
            with srv:
                register(srv, "m0-1")
                warm_up(srv.port, lora_req, concurrency=1, requests=32)
                hz = interleaved({"single": lambda: opts.run(single.port, ping, 1),
                                  name: lambda: opts.run(srv.port, ping, 1)}, rounds=rounds, warmup=1)
                lora = interleaved({"single": lambda: opts.run(single.port, lora_req, 1, keep_bodies=True),
                                    name: lambda: opts.run(srv.port, lora_req, 1, keep_bodies=True)},
                                   rounds=rounds, warmup=1)
                res["layouts"][name] = {
                    "encoder_replicas": enc_replicas, "direct_ingress": direct, "start_s": srv.start_seconds,
                    "healthz_c1": {a: _lat(rs) for a, rs in hz.items()},
                    "lora_c1": {a: {**_lat(rs), "breakdown_ms": breakdown(_merged(rs))} for a, rs in lora.items()}}
            o = res["layouts"][name]
            # The targets' figures: what the layout adds to /healthz, and a LoRA search against the
            # single process of the same minutes.
            o["healthz_added_p50_ms"] = o["healthz_c1"][name]["p50"] - o["healthz_c1"]["single"]["p50"]
            o["lora_p50_ratio"] = o["lora_c1"][name]["p50"] / o["lora_c1"]["single"]["p50"]
            print(f"{name}: /healthz p50 {o['healthz_c1'][name]['p50']:.2f} ms (single "
                  f"{o['healthz_c1']['single']['p50']:.2f}); LoRA search p50 {o['lora_c1'][name]['p50']:.2f} ms "
                  f"(single {o['lora_c1']['single']['p50']:.2f})", file=sys.stderr)
    _write(dirs, res)
    dirs.clean_scratch()
    print(f"wrote {dirs.out}")
    return 0


def _write(dirs: RunDirs, res: dict[str, Any]) -> None:
    rows = []
    for name, o in res["layouts"].items():
        hs, hr = o["healthz_c1"]["single"], o["healthz_c1"][name]
        ls, lr = o["lora_c1"]["single"], o["lora_c1"][name]
        rows.append([name, f"{hs['p50']:.2f}", f"{hr['p50']:.2f}", f"{hr['p50'] - hs['p50']:+.2f}",
                     f"{ls['p50']:.2f}", f"{lr['p50']:.2f}", f"{lr['p50'] / ls['p50']:.2f}",
                     f"{ls['breakdown_ms']['encode_p50']:.2f}", f"{lr['breakdown_ms']['encode_p50']:.2f}",
                     hr["failed"] + lr["failed"]])
    text = ["What each layout of `qswap serve --ray` adds to one request, one ingress replica, one client, "
            "each layout measured alternately with the same single process (its own column: the single "
            "process's figures from the same minutes). `/healthz` does no model work (Serve's proxy); the "
            "LoRA search's encode time includes the hop to the encoder deployment where there is one.", "",
            md_table(["layout", "single /healthz p50 ms", "Ray /healthz p50 ms", "added ms",
                      "single LoRA search p50 ms", "Ray LoRA search p50 ms", "Ray / single",
                      "single encode p50 ms", "Ray encode (+hop) p50 ms", "Ray failed"], rows)]
    dirs.writer.write(res, "\n".join(text))
