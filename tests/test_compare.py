"""fuser.compare.table: an aligned table whatever the systems' names."""

from fuser.compare import Row, table


def test_columns_stay_aligned_with_long_system_names() -> None:
    rows = [Row("fuser", 246.0, 128, 0.52, 3),
            Row("HF static cache + torch.compile (reduce-overhead)", 121.0, 128, 1.06, 3, "peer")]
    lines = table(rows).splitlines()
    # Every line's tok/s column ends at the same character.
    ends = {line.index(word) + len(word) for line, word in
            zip(lines, ("tok/s", "246.0", "121.0"))}
    assert len(ends) == 1, table(rows)
    assert lines[2].startswith("HF static cache + torch.compile (reduce-overhead) ")
