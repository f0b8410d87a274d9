"""Benchmark harness logic on the CPU: dry run of three ops, derived figures, README table, plot data.

Timings on the CPU mean nothing; these tests check the plumbing: records, error isolation
(the seed is pointed at a missing file), exactness checks, JSON contents, targets, the
generated README block and the plot's series.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from kpool import bench
from kpool._backend import interpreting
from kpool.layout import ring_size

BENCH_DIR = bench.find_bench_dir()


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_test_{name}", BENCH_DIR / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


DRY_OPS = ["expand", "seed_tail", "decode"]


@pytest.fixture(scope="module")
def dry_doc(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("KPOOL_BACKEND", "torch")  # fast: our ops through the torch backend
    out = tmp_path_factory.mktemp("bench") / "dry.json"
    try:
        doc = bench.run_benchmarks(ops=DRY_OPS, out_json=str(out), dry_run=True,
                                   seed_path=str(out.parent / "missing_seed.py"), device="cpu", verbose=False)
    finally:
        mp.undo()
    return doc, out


def test_dry_run_records_and_json(dry_doc):
    doc, out = dry_doc
    on_disk = json.loads(out.read_text())
    assert on_disk["meta"]["partial"] is False
    assert on_disk["results"] == json.loads(json.dumps(doc["results"], default=str))
    meta = doc["meta"]
    for key in ("gpu", "torch", "triton", "git", "date_utc", "source_sha256", "mode", "timing_valid"):
        assert key in meta
    assert meta["mode"] == "dry" and meta["timing_valid"] is False
    assert "not found" in meta["seed_error"]
    h = bench.harness()
    plan = h.build_plan(DRY_OPS, "dry", {op: h.load_op_module(op) for op in DRY_OPS})
    assert len(doc["results"]) == len(plan)
    for r in doc["results"]:
        if r["impl"] == "seed":
            assert r["status"] == "error" and "seed baseline unavailable" in r["error"]
        else:
            assert r["status"] == "ok", r
            assert r["us"] > 0 and r["bytes"] > 0 and r["gbps"] > 0
            assert r["timing"].startswith("cpu")
        if r["impl"].startswith("ours"):
            assert r["exact"] is True, r
        if r["op"] == "decode" and r["status"] == "ok":  # ours: the least ring the step allows
            p, nn = r["params"]["P"], r["params"]["next_n"]
            assert r["ring"] == (2 * p if r["impl"] == "ours_ring2P" else ring_size(p, nn - 1)), r
    assert {r["ring"] for r in doc["results"] if (r["op"], r["impl"]) == ("decode", "ours")} == {4, 8, 16, 32}
    assert "score" not in {r["op"] for r in doc["results"]}


def test_table_formats_errors_and_values(dry_doc):
    doc, _ = dry_doc
    text = bench.harness().format_table(doc)
    assert "NOT meaningful" in text
    assert "ERROR" in text and "ours_per_request" in text


def _fake_doc():
    """A GPU-like result document (made-up numbers) pushed through the harness's finalize."""
    h = bench.harness()
    mods = {op: h.load_op_module(op) for op in ("compress", "decode", "expand", "seed_tail", "prefill")}
    results = []
    fake_us = {"ours": 1.0, "ours_ring2P": 1.1, "ours_per_request": 0.5, "ours_gathered": 1.5, "seed": 2.5,
               "seed_upstream": 6.0, "torch": 20.0, "movement": 0.6}
    for op, mod in mods.items():
        for case in mod.cases("full"):
            scale = (case.get("pools") or case.get("rows") or case.get("tokens") or case.get("batch") * 1000) / 1e3
            for impl in mod.impls(case):
                us = fake_us[impl] * scale
                results.append({"op": op, "case": case["label"], "impl": impl, "status": "ok", "error": None,
                                "params": {k: v for k, v in case.items() if k != "label"},
                                "us": us, "bytes": int(4.0e3 * scale * 1e3 * 0.9), "mode": "full"})
                if op == "decode":  # the ring each implementation ran with, as bench_decode records it
                    p, nn = case["P"], case["next_n"]
                    results[-1]["ring"] = {"ours_ring2P": 2 * p, "seed": p}.get(impl, ring_size(p, nn - 1))
    results[1] = {**results[1], "status": "error", "error": "RuntimeError: boom", "us": None}
    h.finalize(results, 4000.0, mods, "full")
    return {"meta": {"gpu": "NVIDIA H200", "mode": "full", "timing_valid": True, "torch": "2.11", "triton": "3.6",
                     "date_utc": "2026-11-30T00:00:00+00:00", "git": {"commit": "abc123", "dirty": False}},
            "copy_bandwidth": {"gbps": 4000.0}, "results": results}


def test_finalize_derives_figures_and_targets():
    doc = _fake_doc()
    by = {(r["op"], r["case"], r["impl"]): r for r in doc["results"]}
    r = by[("compress", "P=4 pools=262144", "ours")]
    assert r["gbps"] == pytest.approx(r["bytes"] / r["us"] / 1e3)
    assert r["frac_copy"] == pytest.approx(r["gbps"] / 4000.0)
    assert r["floor_us"] == pytest.approx(r["us"] * r["frac_copy"])
    assert r["speedup_vs_seed"] == pytest.approx(2.5)
    (t,) = r["targets"]
    assert t["ok"] == (r["frac_copy"] >= 0.85)
    d = by[("decode", "P=4 B=1024 next_n=4", "ours")]
    kinds = {t["kind"]: t["ok"] for t in d["targets"]}
    assert kinds == {"max_vs_seed": True, "max_us": d["us"] <= 3.0}
    assert "speedup_vs_seed" not in by[("compress", "P=4 pools=65536", "seed")]


def test_readme_table_render_and_rewrite(tmp_path):
    rt = _load("readme_table")
    doc = _fake_doc()
    block = rt.render(doc, "benchmarks/results/h200.json")
    assert block.startswith(rt.START) and block.endswith(rt.END)
    assert "NVIDIA H200" in block and "4000 GB/s" in block
    assert "| compress + write | P=16 pools=262144 | ours |" in block
    assert "B=1024" in block and "ours, RING=2P" in block
    assert "| 4 | 4 | data movement only | 8 | 0.60 | 38.4 | 153.6 | 614.4 |" in block  # fake µs: 0.6 x batch
    assert "| 4 | 1 | ours | 4 | " in block and "| 16 | 1 | ours, RING=2P | 32 | " in block
    assert "| 16 | 2 | ours, RING=2P |" not in block  # next_n = 2 runs ours at 2P already: no duplicate row
    no_movement = dict(doc, results=[r for r in doc["results"] if r["impl"] != "movement"])
    assert "data movement only" not in rt.render(no_movement)
    assert "did not complete" in block  # the injected error is reported, not hidden
    assert "Scoring rate" not in block  # no record with a FLOP count
    rec = dict(doc["results"][0], op="score", case="prefill q=8 pools=96", impl="ours", status="ok",
               tflops=33.2, fp8_mm_tflops=1250.0)
    line = rt.flops_line(dict(doc, results=[rec, dict(rec, case="ragged", fp8_mm_tflops=None)]))
    assert line == ["Scoring rate (`2·H·128` FLOP per visible pool per query): prefill q=8 pools=96 33.2 TFLOP/s "
                    "= 0.027 of the measured fp8 matmul (1250 TFLOP/s); ragged 33.2 TFLOP/s."]
    readme = tmp_path / "README.md"
    readme.write_text("# kpool\n\nintro\n")
    json_path = tmp_path / "r.json"
    json_path.write_text(json.dumps(doc))
    rt.main([str(json_path), "--write", str(readme)])
    once = readme.read_text()
    assert once.startswith("# kpool\n\nintro\n") and "## Performance" in once and once.count(rt.START) == 1
    rt.main([str(json_path), "--write", str(readme)])
    assert readme.read_text() == once  # idempotent: the block is replaced in place
    readme.write_text(once.replace(rt.END, ""))
    with pytest.raises(ValueError, match="only one of the markers"):
        rt.main([str(json_path), "--write", str(readme)])


def test_decode_movement_writes_exactly_the_stash(backend, device):
    """``bench_decode.movement`` (the decode table's data-movement reference point) stores
    each token's key and gate rows at ring slot ``pos % RING`` of block ``ts // RING`` and
    nothing else; padding tokens (negative position or tail slot) write nothing. On the
    test device: the Triton backend needs the GPU, or CPU tensors under the interpreter."""
    import torch
    bd, h = _load("bench_decode"), bench.harness()
    ctx = h.Ctx("dry", device)
    for p, b, nn, ring in ((4, 5, 3, 4), (16, 3, 4, 16), (4, 3, 5, 8)):
        kv, tail, ts, key, gate, ape, loc, pos = bd.make_inputs(ctx, b, nn, p, ring, 0)
        pos[0, -1] = -1
        ts[-1, 0] = -1
        expect = tail.clone()
        for r in range(b):
            for j in range(nn):
                if ts[r, j] >= 0 and pos[r, j] >= 0:
                    expect[int(ts[r, j]) // ring, :, int(pos[r, j]) % ring] = torch.stack([key[r, j], gate[r, j]])
        bd.movement(kv, tail, ts, key, gate, ape, loc, pos, p)
        assert torch.equal(tail, expect), (backend, p, b, nn)


def test_decode_extra_steps(monkeypatch):
    """``KPOOL_BENCH_DECODE_STEPS`` (``P:B:NEXT_N`` items) adds decode cases to a mode's grid;
    a malformed item is rejected naming the variable."""
    bd = _load("bench_decode")
    assert bd.extra_steps(" 4:8:1, 16:2:4,") == [(4, 8, 1), (16, 2, 4)]
    monkeypatch.setattr(bd, "EXTRA_STEPS", "16:8:1")
    labels = [c["label"] for c in bd.cases("dry")]
    assert labels[-1] == "P=16 B=8 next_n=1" and len(labels) == len(set(labels))
    for bad in ("4:8", "4:0:1", "8:8:1", "4:x:1"):
        with pytest.raises(ValueError, match="KPOOL_BENCH_DECODE_STEPS"):
            bd.extra_steps(bad)


def test_plot_series_groups_by_impl_and_fixed_params():
    pl = _load("plot")
    data = pl.series(_fake_doc())
    comp = data["compress"]
    assert set(comp) >= {("ours", (("P", 4),)), ("seed", (("P", 16),)), ("torch", (("P", 4),))}
    assert [x for x, _ in comp[("ours", (("P", 16),))]] == [65_536, 262_144]
    dec = data["decode"]
    assert ("ours_ring2P", (("P", 16), ("next_n", 1))) in dec
    assert ("ours_ring2P", (("P", 16), ("next_n", 4))) not in dec  # its ring is ours's there
    assert [x for x, _ in dec[("seed", (("P", 4), ("next_n", 2)))]] == [1, 64, 256, 1024]


def test_plot_series_line_keys():
    """Score lines are told apart by kind and context (not by every parameter that varies, and
    never by a parameter the record lacks); the fp8 encoder records are sized by pools."""
    pl = _load("plot")
    rec = lambda op, impl, params: {"op": op, "impl": impl, "status": "ok", "gbps": 1.0, "params": params}
    dec = dict(kind="decode", next_n=1, index_topk=2048, P=4, heads=32)
    doc = {"results": [rec("score", "ours", dict(dec, batch=1, ctx=131072, rows=1)),
                       rec("score", "ours", dict(dec, batch=32, ctx=131072, rows=32)),
                       rec("score", "ours", dict(dec, batch=128, ctx=1048576, rows=128)),
                       rec("score", "ours", dict(kind="prefill", queries=8192, pools=32768, rows=8192, P=4)),
                       rec("fp8", "native", dict(P=4, pools=262144, page=64)),
                       rec("fp8", "native", dict(P=16, pools=262144, page=64))]}
    data = pl.series(doc)
    assert data["score"] == {("ours", (("kind", "decode"), ("ctx", 131072))): [(1, 1.0), (32, 1.0)],
                             ("ours", (("kind", "decode"), ("ctx", 1048576))): [(128, 1.0)],
                             ("ours", (("kind", "prefill"), ("pools", 32768))): [(8192, 1.0)]}
    assert data["fp8"] == {("native", (("P", 4),)): [(262144, 1.0)], ("native", (("P", 16),)): [(262144, 1.0)]}


def test_gpu_slug():
    h = bench.harness()
    assert h.gpu_slug("NVIDIA H200") == "h200"
    assert h.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert h.gpu_slug("AMD Instinct MI300X") == "mi300x"
    assert h.gpu_slug(None) == "cpu"


def test_target_table(tmp_path):
    """Every judged target has a row with its measured figure; decode's "<= seed" (48 records)
    is one summary row; ``--notes`` rewrites only the marked block, and a file without the
    markers is an error, not an appended section."""
    rt = _load("readme_table")
    doc = _fake_doc()
    rows = rt.targets_table(doc)
    by = {(r["op"], r["case"], r["impl"]): r for r in doc["results"]}
    c = by[("compress", "P=4 pools=262144", "ours")]
    mark = "✅" if c["frac_copy"] >= 0.85 else "❌"
    assert (f"| compress + write | P=4 pools=262144 | >=0.85 of floor | {c['frac_copy']:.2f} of copy BW "
            f"(needs 0.85) | {mark} |") in rows
    seed_rows = [r for r in rows if "| <= seed |" in r]
    judged = [r for r in doc["results"] if any(t["text"] == "<= seed" for t in r.get("targets", []))]
    least = min(r["speedup_vs_seed"] for r in judged)
    assert len(judged) > rt.GROUPED and seed_rows == [
        f"| decode / verify update | {len(judged)} cases | <= seed | {len(judged)} met (least speedup over the seed "
        f"{least:.2f}×) | ✅ |"]
    assert "| ring seeding | P=4 R=64 T=65536, ours (per request) | <= 5 us |" in "\n".join(rows)
    notes = tmp_path / "NOTES.md"
    notes.write_text(f"# n\n\n{rt.TARGETS_START}\nold\n{rt.TARGETS_END}\n\nkept\n")
    (tmp_path / "r.json").write_text(json.dumps(doc))
    rt.main([str(tmp_path / "r.json"), "--notes", str(notes)])
    text = notes.read_text()
    assert "old" not in text and text.endswith("\n\nkept\n") and rows[-1] in text
    notes.write_text("# n\n")
    with pytest.raises(ValueError, match="none of the markers"):
        rt.main([str(tmp_path / "r.json"), "--notes", str(notes)])


def test_committed_tables_match_the_results_json():
    """The README's performance block and NOTES.md's target block are what the committed
    results render to: regenerate them (``readme_table.py ... --write README.md --notes
    benchmarks/NOTES.md``) whenever ``results/h200.json`` changes."""
    rt = _load("readme_table")
    src = "benchmarks/results/h200.json"
    doc = json.loads((BENCH_DIR / "results" / "h200.json").read_text())
    for path, block, start, end in ((BENCH_DIR.parent / "README.md", rt.render(doc, src), rt.START, rt.END),
                                    (BENCH_DIR / "NOTES.md", rt.render_targets(doc, src), rt.TARGETS_START,
                                     rt.TARGETS_END)):
        text = path.read_text()
        assert text[text.index(start):text.index(end) + len(end)] == block, f"{path.name} is stale"


def test_other_gpus_tables_match_their_results_json():
    """Each other GPU's committed table (``results/<gpu>.md``, e.g. the H100's) is what its
    ``results/<gpu>.json`` renders to (``readme_table.py results/<gpu>.json --write results/<gpu>.md``)."""
    rt = _load("readme_table")
    tables = sorted((BENCH_DIR / "results").glob("*.md"))
    assert tables, "no committed results/<gpu>.md"
    for md in tables:
        src = f"benchmarks/results/{md.stem}.json"
        block = rt.render(json.loads((BENCH_DIR / "results" / f"{md.stem}.json").read_text()), src)
        text = md.read_text()
        assert text[text.index(rt.START):text.index(rt.END) + len(rt.END)] == block, f"{md.name} is stale"


def test_bench_host_runs_and_renders(tmp_path, monkeypatch):
    """``bench_host.py`` (host time of KPoolCache steps, kernels stubbed on the CPU): the cases
    it is told to run, one record each, and the README block between its markers."""
    import kpool.cache as cache_mod
    bh = _load("bench_host")
    for name, fn in bh.stubs().items():
        assert callable(getattr(cache_mod, name)), name  # every stub replaces a real entry point
        monkeypatch.setattr(cache_mod, name, fn)
    monkeypatch.setattr(bh, "stubs", lambda: {})  # main would install them for good
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- host:start -->\nold\n<!-- host:end -->\ntail\n")
    out = tmp_path / "host.json"
    assert bh.main(["--reps", "2", "--rounds", "1", "--only", "R=1 |B=1 ", "--device", "cpu", "--out", str(out),
                    "--readme", str(readme)]) == 0
    doc = json.loads(out.read_text())
    assert [r["label"] for r in doc["records"]] == [
        "prefill R=1 L=8192", "decode + accept B=1 next_n=1 ctx=4096", "decode + accept B=1 next_n=4 ctx=4096",
        "write_layer B=1 next_n=4 ctx=4096", "topk_indices B=1 next_n=4 ctx=4096",
        "topk_indices (next layer) B=1 next_n=4 ctx=4096"]
    assert all(r["reps"] == 2 and r["us"] > 0 for r in doc["records"]) and doc["environment"]["kernels"] == "stubbed"
    text = readme.read_text()
    assert "old" not in text and text.endswith("<!-- host:end -->\ntail\n") and "| topk_indices B=1" in text


@pytest.mark.parametrize("name", ["host_cpu.json", "host_h200.json"])
def test_committed_host_tables_match_their_json(name, tmp_path):
    """The README's host-time blocks (kernels stubbed; real, on the H200) are what
    ``results/host_*.json`` render to, as ``bench_host.py --from`` writes them."""
    bh = _load("bench_host")
    source = f"benchmarks/results/{name}"
    doc = dict(json.loads((BENCH_DIR / "results" / name).read_text()), path=source)
    start, end = bh.markers(doc)
    assert (start, end) == ((bh.START, bh.END) if name == "host_cpu.json" else (bh.GPU_START, bh.GPU_END))
    text = (BENCH_DIR.parent / "README.md").read_text()
    block = text[text.index(start) + len(start) + 1:text.index(end) - 1]
    assert block == bh.table(doc), f"README.md's host-time table is stale: rerun bench_host.py --from {source}"
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{start}\nold\n{end}\nb\n")
    assert bh.main(["--from", str(BENCH_DIR / "results" / name), "--readme", str(readme)]) == 0
    assert readme.read_text() == f"a\n{start}\n{bh.table(dict(doc, path=str(BENCH_DIR / 'results' / name)))}\n{end}\nb\n"


def test_bench_host_stubs_only_the_launches(monkeypatch):
    """``--stub launches``: the ops' host work runs, Triton's launches return at once (CPU,
    interpreter; the launcher is restored after the test); without the interpreter it refuses."""
    from triton.runtime import interpreter
    bh = _load("bench_host")
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", interpreter.InterpretedFunction.run)
    monkeypatch.setenv("KPOOL_BACKEND", "triton")
    args = ["--stub", "launches", "--device", "cpu", "--reps", "1", "--rounds", "1", "--only", "write_layer B=1 "]
    if not interpreting():
        with pytest.raises(SystemExit, match="TRITON_INTERPRET=1"):
            bh.main(args)
        return
    calls = []
    monkeypatch.setattr(bh, "measure", lambda case, device, reps: calls.append(case["op"]) or [1.0])
    assert bh.main(args) == 0 and calls == ["write_layer"]
    assert interpreter.InterpretedFunction.run(None) is None  # the stub
    with pytest.raises(SystemExit, match="no README section"):
        bh.markers({"environment": {"kernels": "launches stubbed"}})


def test_merge_results_replaces_one_op_family(tmp_path):
    """A partial run's records of the named ops replace the full run's where they stood; the rest
    and the full run's meta stay; the README header names the partial run's commit and bandwidth."""
    mr, rt = _load("merge_results"), _load("readme_table")
    full = {"meta": {"git": {"commit": "aaaaaaa"}, "date_utc": "2026-11-30T10:00:00+00:00", "gpu": "G"},
            "copy_bandwidth": {"gbps": 4000.0},
            "results": [{"op": "score", "case": "old", "impl": "ours", "us": 9.0},
                        {"op": "compress", "case": "keep", "impl": "ours", "us": 3.0}]}
    part = {"meta": {"git": {"commit": "bbbbbbb"}, "date_utc": "2026-12-01T10:00:00+00:00", "command": ["x"]},
            "copy_bandwidth": {"gbps": 4100.0},
            "results": [{"op": "score", "case": "new", "impl": "ours", "us": 1.0},
                        {"op": "compress", "case": "ignored", "impl": "ours", "us": 5.0}]}
    out = mr.merge(full, part, {"score"})
    assert [(r["op"], r["case"]) for r in out["results"]] == [("score", "new"), ("compress", "keep")]  # in place
    assert out["meta"]["git"]["commit"] == "aaaaaaa" and out["copy_bandwidth"]["gbps"] == 4000.0
    assert out["meta"]["merged"] == [{"ops": ["score"], "commit": "bbbbbbb", "date_utc": "2026-12-01T10:00:00+00:00",
                                      "copy_gbps": 4100.0, "command": ["x"]}]
    assert "commit `bbbbbbb` (2026-12-01), copy bandwidth 4100 GB/s." in rt.merged_note(out["meta"])
    with pytest.raises(SystemExit, match="decode"):
        mr.merge(full, part, {"decode"})
    # merging again: the earlier merge's ops that are replaced leave its entry, the others stay
    again = dict(part, meta=dict(part["meta"], git={"commit": "ccccccc"}))
    twice = mr.merge(mr.merge(full, part, {"score", "compress"}), again, {"score"})
    assert [(m["ops"], m["commit"]) for m in twice["meta"]["merged"]] == [(["compress"], "bbbbbbb"), (["score"], "ccccccc")]
    assert [m["commit"] for m in mr.merge(out, again, {"score"})["meta"]["merged"]] == ["ccccccc"]


def test_case_and_impl_filters(tmp_path, capsys, monkeypatch):
    """``--cases`` (a regular expression on the label) and ``--impls`` pick units; a name that
    is no implementation, or a filter that matches nothing, is an error naming it; a filtered
    run records its filter and cannot be merged into a results file."""
    h = bench.harness()
    mods = {op: h.load_op_module(op) for op in ("decode", "compress")}
    plan = h.build_plan(["decode", "compress"], "full", mods, r"^P=4 B=1024 next_n=4$|P=16 pools=65536",
                        {"ours", "seed"})
    labels = [(op, mods[op].cases("full")[ci]["label"], impl) for op, ci, impl in plan]
    assert labels == [("decode", "P=4 B=1024 next_n=4", "ours"), ("decode", "P=4 B=1024 next_n=4", "seed"),
                      ("compress", "P=16 pools=65536", "ours"), ("compress", "P=16 pools=65536", "seed")]
    assert len(h.build_plan(["decode"], "full", mods)) == sum(len(mods["decode"].impls(c))
                                                               for c in mods["decode"].cases("full"))
    with pytest.raises(ValueError, match=r"\['our'\]"):
        h.build_plan(["decode"], "full", mods, None, {"our"})
    with pytest.raises(ValueError, match="matches"):
        h.build_plan(["decode"], "full", mods, "B=7", None)
    assert bench.main(["--list", "--ops", "decode", "--impls", "our"]) == 2
    assert "['our']" in capsys.readouterr().err
    from kpool.cli import main as kpool_main  # the console script hands every option to kpool.bench
    assert kpool_main(["bench", "--list", "--ops", "decode", "--cases", "P=16 B=1024 next_n=4", "--impls", "ours"]) == 0
    assert capsys.readouterr().out.split() == ["decode", "P=16", "B=1024", "next_n=4", "ours"]
    monkeypatch.setenv("KPOOL_BACKEND", "torch")
    doc = bench.run_benchmarks(ops=["expand"], dry_run=True, device="cpu", verbose=False,
                               seed_path=str(tmp_path / "missing_seed.py"), cases="P=4", impls=["ours"])
    assert {(r["case"], r["impl"]) for r in doc["results"]} == {
        (c["label"], "ours") for c in h.load_op_module("expand").cases("dry") if "P=4" in c["label"]}
    assert doc["meta"]["filter"] == {"cases": "P=4", "impls": ["ours"]}
    with pytest.raises(SystemExit, match="subset"):
        _load("merge_results").merge(doc, doc, {"expand"})


def test_profile_mode_runs_each_unit_without_timing(tmp_path, monkeypatch):
    """``--profile``: every selected unit runs (warm-up + the profiled call), nothing is timed,
    the document says so and cannot be merged into a results file."""
    monkeypatch.setenv("KPOOL_BACKEND", "torch")
    calls = []
    h = bench.harness()
    orig = h.Ctx.run

    def spy(self, fn, make_set, **kw):
        calls.append(self.profile)
        return orig(self, lambda *a: (calls.append("call"), fn(*a)), make_set, **kw)

    monkeypatch.setattr(h.Ctx, "run", spy)
    doc = bench.run_benchmarks(ops=["expand"], dry_run=True, device="cpu", verbose=False, impls=["ours"],
                               seed_path=str(tmp_path / "missing_seed.py"), profile=True)
    assert doc["meta"]["profile"] is True
    n = len(doc["results"])
    assert n > 0 and calls == [True, "call", "call"] * n
    for r in doc["results"]:
        assert r["status"] == "ok" and r["us"] is None and r["timing"].startswith("profiled"), r
        assert "gbps" not in r and all(t["ok"] is None for t in r.get("targets", []))
    with pytest.raises(SystemExit, match="profiling run"):
        _load("merge_results").merge(doc, doc, {"expand"})


def test_ab_runs_each_variant_in_its_own_tree(tmp_path, capsys, monkeypatch):
    """``benchmarks/ab.py``: one process per variant, its tree first on the path and its patch
    applied; a variant that fails is reported and the others still give records."""
    ab = _load("ab")
    src = str(BENCH_DIR.parent / "src")
    monkeypatch.setenv("KPOOL_BACKEND", "torch")
    out = tmp_path / "ab.json"
    rc = ab.main(["--op", "expand", "--mode", "dry", "--device", "cpu", "--impls", "ours", "--out", str(out),
                  "--variant", f"plain={src}", "--variant", f"broken={src}::raise SystemExit(3)"])
    doc = json.loads(out.read_text())
    recs = doc["records"]
    assert rc == 0 and recs and {r["variant"] for r in recs} == {"plain"}
    assert all(r["kpool_file"].startswith(src) and r["impl"] == "ours" and r["occupy_sms"] == 0 for r in recs)
    (meta,) = doc["variants"]  # the failed variant gave none
    assert meta["holds"] == [{"occupy_sms": 0, "copy_gbps": None}]
    assert meta["variant"] == "plain" and meta["kpool_file"].startswith(src) and meta["torch"] == torch.__version__
    assert meta["git"]["source"] in ("git", "KPOOL_GIT_COMMIT", "unavailable") and meta["source_sha256"]
    assert "broken: exit 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--op", "expand"])
    with pytest.raises(SystemExit):
        ab.main(["--op", "expand", "--device", "cpu", "--occupy-sms", "0,39", "--variant", f"plain={src}"])
    assert "--occupy-sms holds SMs of a CUDA device" in capsys.readouterr().err


def test_force_plan_sets_the_scorers_leaves_where_the_shape_allows(monkeypatch):
    """``force_plan.install``: plans of several leaves take the forced size, exact only where the
    leaves keep all their keys and filtering only where ``score.filters`` allows; one-leaf plans
    and impossible ones stay ``wide_plan``'s."""
    from kpool.ops import score, topk
    monkeypatch.setattr(topk, "_sm_count", lambda device: 132)
    monkeypatch.delenv(score.SCORER_ENV, raising=False)
    monkeypatch.setattr(score, "wide_plan", score.wide_plan)  # restored after the test
    real = score.wide_plan
    _load("force_plan").install(512, filtered=False)
    assert real(64, 2048, 512, "cuda") == (256, 8, False)
    assert score.wide_plan(64, 2048, 512, "cuda") == (512, 4, False)
    assert score.wide_plan(1, 300, 512, "cuda") == real(1, 300, 512, "cuda")  # one leaf
    assert score.wide_plan(64, 2048, 128, "cuda") == real(64, 2048, 128, "cuda")  # 512 > KB: not exact
    score.wide_plan = real
    _load("force_plan").install(256, filtered=True)
    assert score.wide_plan(64, 2048, 512, "cuda") == (256, 8, True)
    assert score.wide_plan(16, 16384, 512, "cuda", groups=8) == (256, 64, True)
    assert score.wide_plan(64, 1024, 512, "cuda") == real(64, 1024, 512, "cuda")  # bound rank 128: no filter


def test_size_sweep_scales_one_parameter_and_fits(tmp_path, capsys, monkeypatch):
    """``benchmarks/size_sweep.py``: the case's ``--key`` set to each size (label too), every impl
    timed, a least-squares fixed + per-unit fit; an unknown case or key is refused."""
    sweep = _load("size_sweep")
    assert sweep.fit([(1, 5.0), (2, 7.0), (4, 11.0)]) == pytest.approx((3.0, 2.0))
    monkeypatch.setenv("KPOOL_BACKEND", "torch")
    out = tmp_path / "sweep.json"
    rc = sweep.main(["--op", "expand", "--case", "P=4 rows=8192 topk=2048", "--key", "rows", "--sizes", "2,3,5",
                     "--impls", "copy,ours", "--mode", "dry", "--device", "cpu", "--sustain-s", "0.5",
                     "--out", str(out)])
    doc = json.loads(out.read_text())
    assert rc == 0 and [(r["case"], r["impl"]) for r in doc["records"]] == [
        (f"P=4 rows={n} topk=2048", impl) for n in (2, 3, 5) for impl in ("ours", "copy")]
    assert all(r["us"] > 0 and r["bytes"] > 0 and r["floor_us"] is None for r in doc["records"])
    assert not any("us_sustained" in r for r in doc["records"])  # sustained load: graph replays (CUDA) only
    ours, copy = ([r for r in doc["records"] if r["impl"] == i] for i in ("ours", "copy"))
    assert [c["bytes"] for c in copy] == [max(o["bytes"] // 16, 1) * 16 for o in ours]  # the op's bytes
    assert set(doc["fits"]) == {"ours", "copy"} and doc["meta"]["torch"] == torch.__version__
    base = ["--op", "expand", "--sizes", "2", "--mode", "dry", "--device", "cpu"]
    for bad in (["--case", "P=4 rows=1", "--key", "rows"], ["--case", "P=4 rows=8192 topk=2048", "--key", "width"],
                ["--case", "P=4 rows=8192 topk=2048", "--key", "rows", "--impls", "copy"]):
        with pytest.raises(SystemExit):
            sweep.main(base + bad)
    err = capsys.readouterr().err
    assert "no full-mode case" in err and "name one beside it" in err


def test_sustained_load_samples(tmp_path, monkeypatch):
    """``harness._nvidia_smi`` reads one CSV line of the query's fields (bare numbers with
    ``units=False``), ``{}`` without nvidia-smi; ``load_summary`` takes the clock's median and
    least, the power's median and most, ORs the throttle masks and skips unreadable values."""
    harness = _load("harness")
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f'#!/bin/sh\necho "$2" > {tmp_path / "args"}\necho "1755, 688.25, 0x0000000000000004"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert harness._nvidia_smi(harness.SUSTAIN_QUERY, units=False) == {
        "clocks.sm": "1755", "power.draw": "688.25", "clocks_throttle_reasons.active": "0x0000000000000004"}
    assert (tmp_path / "args").read_text().strip() == "--format=csv,noheader,nounits"
    fake.unlink()
    assert harness._nvidia_smi(harness.SUSTAIN_QUERY, units=False) == {}
    samples = [{"clocks.sm": "1980", "power.draw": "612.5", "clocks_throttle_reasons.active": "0x0000000000000000"},
               {"clocks.sm": "1755", "power.draw": "699.0", "clocks_throttle_reasons.active": "0x0000000000000004"},
               {"clocks.sm": "1800", "power.draw": "[N/A]", "clocks_throttle_reasons.active": "0x0000000000000020"},
               {"power.draw": "650.0"}]
    assert harness.load_summary(samples) == {"samples": 4, "sm_mhz": 1800.0, "sm_mhz_min": 1755.0,
                                             "power_w": 650.0, "power_w_max": 699.0, "throttle_mask": "0x24"}
    assert harness.load_summary([]) == {"samples": 0, "sm_mhz": None, "sm_mhz_min": None, "power_w": None,
                                        "power_w_max": None, "throttle_mask": None}


@pytest.mark.parametrize("placement", ["apart", "offset", "interleaved"])
def test_compress_gate_placements(placement, monkeypatch):
    """``KPOOL_BENCH_GATES``: the compress benchmark's gates two allocations apart, a few KB after
    the keys in one buffer, or interleaved with them per token; the Triton kernel writes the
    reference's bytes from each; another name is refused by ``cases``."""
    harness, bc = _load("harness"), _load("bench_compress")
    monkeypatch.setenv("KPOOL_BACKEND", "triton")  # the kernel reads the views; the oracle, CPU copies
    monkeypatch.setattr(bc, "GATES", placement)
    ctx = harness.Ctx("dry", "cpu", check=True)
    p, n = 4, 40
    kv, k, g, ape, loc = bc.make_inputs(ctx, p, n, 0)
    assert k.shape == g.shape == (n, p, 128) and k.dtype == g.dtype == torch.bfloat16
    step = g.data_ptr() - k.data_ptr()
    if placement == "offset":
        assert step == n * p * 128 * 2 + bc.GATES_OFFSET
    elif placement == "interleaved":
        assert step == 256 and k.stride() == g.stride() == (p * 256, 256, 1)
    else:
        assert k.is_contiguous() and g.is_contiguous()
    assert [c["label"] for c in bc.cases("dry")] == ["P=4 pools=16", "P=16 pools=16"]
    rec = bc.bench(ctx, bc.cases("dry")[0], "ours")
    assert rec["exact"] and rec["gates"] == placement, rec.get("exact_note")
    monkeypatch.setattr(bc, "GATES", "together")
    with pytest.raises(ValueError, match="KPOOL_BENCH_GATES"):
        bc.cases("dry")
