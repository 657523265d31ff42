"""``available_memory_bytes``: MemAvailable from a meminfo file, ``None`` when it cannot tell."""

from mergeqp.io.memory import available_memory_bytes


def test_reads_mem_available_in_bytes(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:    2048 kB\n")
    assert available_memory_bytes(str(f)) == 2048 * 1024


def test_unknown_when_missing_or_malformed(tmp_path):
    assert available_memory_bytes(str(tmp_path / "absent")) is None
    f = tmp_path / "meminfo"
    f.write_text("MemTotal: 1 kB\n")
    assert available_memory_bytes(str(f)) is None
    f.write_text("MemAvailable: lots kB\n")
    assert available_memory_bytes(str(f)) is None


def test_this_machine_reports_a_positive_amount_or_none():
    got = available_memory_bytes()
    assert got is None or got > 0
