"""Smoke runs of the fabric benchmarks (bench.fabric.*): the transfer bench on one provider, page
kind and size (its C reference built with cc), and the checksum bench on a few calls; each report
checked for the numbers it promises."""

from __future__ import annotations

import shutil

import pytest
from bench_smoke import assert_json_stamped, assert_stamped, positive
from support import native

from kv_messenger import checksum

pytestmark = pytest.mark.integration   # peer processes: the integration suite's kind


FABRIC_MISSING = native.import_errors().get("fabric._libfabric")


@native.skip_unless_built(FABRIC_MISSING is None, "the libfabric extension (fabric._libfabric)", FABRIC_MISSING)
@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler for bench/fabric/fi_bench.c")
def test_transfer_one_row(bench):
    run = bench("bench.fabric.transfer", "--providers", "shm", "--pages", "huge", "--sizes", "65536",
                "--bytes", str(4 << 20), "--record", "--tag", "smoke", "--results-dir", "{out}")
    data = run.json("fabric-smoke")
    (row,) = data["rows"]
    assert row["provider"] == "shm" and row["huge"] and row["size"] == 65536, row
    for key in ("c_gbps", "py_gbps", "py_coalesced_gbps", "c_cma_gbps", "c_lat_us", "py_lat_p50_us",
                "py_sync_lat_p50_us", "py_busy_lat_p50_us", "pct_of_c"):
        assert positive(row[key]), (key, row[key])
    assert data["fabric"]["libfabric"] and data["fabric"]["thp"]
    assert_json_stamped(data, "bench.fabric.transfer")
    md = run.md("fabric-smoke")
    assert "| shm | huge | 64 KiB |" in md
    assert_stamped(md, "bench.fabric.transfer")


def test_ucx_one_row(bench):
    run = bench("bench.fabric.ucx", "--sizes", "262144", "--bytes", str(4 << 20), "--repeat", "1",
                "--backends", "ucx-tcp", "--no-perftest", "--record", "--tag", "smoke", "--results-dir", "{out}")
    data = run.json("ucx-smoke")
    assert positive(data["rows"]["ucx-tcp"]["262144"][0]), data
    assert_json_stamped(data, "bench.fabric.ucx")
    md = run.md("ucx-smoke")
    assert "| 256 KiB |" in md
    assert_stamped(md, "bench.fabric.ucx")


@native.skip_unless_built(checksum.available(), "the checksum extension", checksum.unavailable_reason())
def test_checksum(bench):
    run = bench("bench.fabric.checksum", "--repeat", "3", "--record", "--results-dir", "{out}")
    md = run.md("checksum")
    rows = [line for line in md.splitlines() if line.startswith(("| zlib.crc32", "| crc32c"))]
    assert rows[0].startswith("| zlib.crc32") and any(r.startswith("| crc32c_runs table") for r in rows), rows
    assert all(line.count("|") == 6 for line in rows), rows
    assert_stamped(md, "bench.fabric.checksum")
