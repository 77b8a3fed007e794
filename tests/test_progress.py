"""Progress on stderr: a tqdm bar on a terminal, one plain line per stage anywhere else."""

from __future__ import annotations

import io

from latentkv.cli import main
from latentkv.progress import progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_gets_one_line_per_stage():
    log = io.StringIO()
    assert list(progress(range(5), "loading layers", "layer", stream=log)) == [0, 1, 2, 3, 4]
    text = log.getvalue()
    assert "\r" not in text and text.count("\n") == 1
    assert text.startswith("loading layers: 5/5 layers in ") and text.endswith(" s\n")


def test_an_iterator_without_a_length_counts_what_it_gave():
    log = io.StringIO()
    assert list(progress(iter("abc"), "opening shards", "shard", stream=log)) == ["a", "b", "c"]
    assert log.getvalue().startswith("opening shards: 3 shards in ")


def test_a_terminal_gets_the_redrawn_bar():
    tty = FakeTerminal()
    assert list(progress(range(3), "loading layers", "layer", stream=tty)) == [0, 1, 2]
    assert "\r" in tty.getvalue() and "3/3" in tty.getvalue()


def test_a_command_logged_to_a_file_writes_no_carriage_returns(capsys):
    code = main(["generate", "builtin:tiny", "--prompt-ids", "5,6,7", "--max-tokens", "2", "--ignore-eos"])
    err = capsys.readouterr().err
    assert code == 0
    assert "\r" not in err
    assert "loading layers: 5/5 layers in " in err  # builtin:tiny has 5 layers
