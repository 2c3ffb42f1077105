"""docs/results.md and the README's results table are what the recordings give (python -m mhc_lab.bench results)."""

from mhc_lab.bench import results


def test_results_and_readme_table_match_the_recordings(capsys):
    assert results.main(["--check"]) == 0, capsys.readouterr().out


def test_readme_table_has_at_most_eight_rows_each_with_where_and_when():
    table = results.readme_table(results.load_all()).splitlines()[2:]
    assert 0 < len(table) <= 8
    for row in table:
        assert "H200" in row and "2026-" in row, row
