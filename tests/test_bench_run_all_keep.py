"""bench/run_all.py --keep-other-parts: the sections of the RESULTS.md it replaces, by part; bench/cpu_info.py."""

from __future__ import annotations

from support.bench import load_bench_module

run_all = load_bench_module("run_all")
cpu_info = load_bench_module("cpu_info")

RESULTS = """# primerl benchmarks (issue 12)

| part | script | status |
|---|---|---|

### a. part a's title

a's body
_kept from an earlier run (`--keep-other-parts`): written 2026-11-25 04:26 UTC_

## (c) Rollout path

c's body

### e. Weight updates

e1

### e (delta sizes). Sparse deltas

e2

### f. bench/async_levels.py

**not run: not selected, and no earlier section to keep**

"""


def test_sections_of_an_earlier_results_file_by_part(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text(RESULTS)
    sections = run_all.sections_of(path)
    assert sorted(sections) == ["a", "c", "e"]  # f's "not run" placeholder is not a section to keep
    assert sections["a"] == ["### a. part a's title\n\na's body\n"]  # the earlier keep's note is dropped
    assert sections["c"][0].startswith("## (c) Rollout path")
    assert [s.splitlines()[0] for s in sections["e"]] == ["### e. Weight updates", "### e (delta sizes). Sparse deltas"]
    assert run_all.sections_of(tmp_path / "missing.md") == {}


def test_two_entries_of_one_part_have_their_own_files():
    stems = [p.stem for p in run_all.PARTS if p.key == "f"]
    assert len(stems) == 2 and len(set(stems)) == 2
    assert any(p.key == "cpu" for p in run_all.PARTS)


def test_cpu_phrase_names_model_extensions_and_cores():
    info = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 avx512f amx_tile\n"
    phrase = cpu_info.cpu_phrase(info)
    assert phrase.startswith("Intel(R) Xeon(R) Processor (AVX-512, AMX), ") and phrase.endswith(" cores")
    assert cpu_info.cpu_phrase("model name : Some CPU\nflags : sse avx2\n").startswith("Some CPU (AVX2), ")
    assert cpu_info.cpu_phrase("").startswith("unknown CPU, ")
