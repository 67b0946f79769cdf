"""APAR structure: paragraph trees, restore by traversal, extraction rules, control-token conventions."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_specdec.apar import Fork, ParagraphTree, find_control_tokens, restore_tokens, tree_from_events
from mlx_specdec.apar.extract import complete_part, extract, is_ambiguous

# ---------------------------------------------------------------------------------------------
# ParagraphTree
# ---------------------------------------------------------------------------------------------


def _nested_tree():
    tree = ParagraphTree()
    tree.add(0, "A1 ")
    c1 = tree.fork(0)
    tree.add(c1, "b1 ")
    g = tree.fork(c1)
    tree.add(g, "g ")
    tree.add(c1, "b2 ")
    tree.add(0, "A2 ")
    c2 = tree.fork(0)
    tree.add(c2, "c ")
    tree.add(0, "A3")
    return tree, c1, g, c2


def test_restore_expands_each_fork_depth_first():
    tree, c1, g, c2 = _nested_tree()
    assert (c1, g, c2) == (1, 2, 3)
    assert tree.restore_text() == "A1 b1 g b2 A2 c A3"
    assert tree.children(0) == [1, 3] and tree.children(1) == [2]
    assert tree.depth == {0: 0, 1: 1, 2: 2, 3: 1} and tree.max_depth == 2
    assert tree.forked and tree.threads == [0, 1, 2, 3]
    assert tree.own(0) == ["A1 ", "A2 ", "A3"]


def test_streams_and_root_paths_use_the_control_pieces():
    tree, c1, g, c2 = _nested_tree()
    assert tree.stream(0, "<F>") == ["A1 ", "<F>", "A2 ", "<F>", "A3"]
    assert tree.root_path(0, "<F>", "<C>") == ["A1 ", "<F>", "A2 ", "<F>", "A3"]
    assert tree.root_path(c1, "<F>", "<C>") == ["A1 ", "<F>", "<C>", "b1 ", "<F>", "b2 "]
    assert tree.root_path(g, "<F>", "<C>") == ["A1 ", "<F>", "<C>", "b1 ", "<F>", "<C>", "g "]
    assert tree.root_path(c2, "<F>", "<C>") == ["A1 ", "<F>", "A2 ", "<F>", "<C>", "c "]


def test_fork_refuses_an_existing_thread_and_map_keeps_the_shape():
    tree, *_ = _nested_tree()
    with pytest.raises(ValueError, match="exists"):
        tree.fork(0, 2)
    chars = tree.map(lambda piece: list(piece))
    assert "".join(chars.restore()) == tree.restore_text()
    assert chars.streams[0][3] == Fork(1)  # "A1 " became three pieces


def test_tree_from_events_places_children_where_their_start_event_is():
    E = lambda kind, tid, parent=None, tokens=(): SimpleNamespace(  # noqa: E731
        kind=kind, thread_id=tid, parent_id=parent, tokens=list(tokens))
    events = [E("token", 0, tokens=[1, 2]), E("thread_start", 1, 0), E("token", 0, tokens=[3]),
              E("token", 1, 0, [10]), E("thread_start", 2, 1), E("token", 1, 0, [11]),
              E("token", 2, 1, [20]), E("thread_end", 2, 1), E("token", 0, tokens=[4]),
              E("token", 0, tokens=[]), E("done", 0)]
    tree = tree_from_events(events)
    assert tree.streams == {0: [1, 2, Fork(1), 3, 4], 1: [10, Fork(2), 11], 2: [20]}
    assert restore_tokens(events) == [1, 2, 10, 20, 11, 3, 4]


# ---------------------------------------------------------------------------------------------
# Extraction rules
# ---------------------------------------------------------------------------------------------

LIST_ANSWER = """Good sleep takes a few habits. Here are some tips:

1. **Keep a schedule**: Go to bed at the same time every night, even on weekends.
2. Limit screens: Blue light from phones delays sleep, so stop an hour before bed.

3. Watch caffeine: Avoid coffee after lunch; it stays in your body for hours.

Sleep well and wake up rested!"""


def test_ordered_list_forks_after_each_phrase():
    e = extract(LIST_ANSWER)
    assert e.kind == "list" and e.structured and e.forks == 3
    t = e.tree
    assert t.streams[0] == [
        "Good sleep takes a few habits. Here are some tips:\n\n1. **Keep a schedule**:", Fork(1),
        "\n2. Limit screens:", Fork(2), "\n\n3. Watch caffeine:", Fork(3),
        "\n\nSleep well and wake up rested!"]
    assert t.streams[1] == [" Go to bed at the same time every night, even on weekends."]
    assert t.streams[2] == [" Blue light from phones delays sleep, so stop an hour before bed."]
    assert t.streams[3] == [" Avoid coffee after lunch; it stays in your body for hours."]
    assert t.restore_text() == LIST_ANSWER


@pytest.mark.parametrize("answer, why", [
    ("1. A: first detail here.\n2. B: second detail here.", "two items"),
    ("1. A: first detail here.\n2. B: short.\n3. C: third detail here.", "a detail under 10 chars"),
    ("1. A: first detail here.\n2. No colon in this item at all\n3. C: third detail here.", "an item without phrase:"),
    ("1. Choose a picture.\n2. Mark the wall.\n3. Hang the picture.\n4. Step back.", "no phrase: heads"),
])
def test_lists_that_break_the_rules_do_not_fork(answer, why):
    assert extract(answer).kind == "none", why


PARAGRAPHS = """Recorded voices sound strange to us. You normally hear yourself through your bones as well as the air. That adds bass.

A microphone only picks up the air. It misses the bone-conducted part entirely.

Short one.

Key points:
- bones
- air

Most people dislike their recorded voice at first. Dr. Smith says they get used to it over time."""


def test_paragraphs_fork_after_their_first_sentence():
    e = extract(PARAGRAPHS)
    assert e.kind == "paragraphs" and e.forks == 3
    t = e.tree
    assert t.streams[0] == [
        "Recorded voices sound strange to us.", Fork(1),
        "\n\nA microphone only picks up the air.", Fork(2),
        "\n\nShort one.\n\nKey points:\n- bones\n- air\n\nMost people dislike their recorded voice at first.",
        Fork(3)]
    assert t.streams[1] == [" You normally hear yourself through your bones as well as the air. That adds bass."]
    assert t.streams[3] == [" Dr. Smith says they get used to it over time."]
    assert t.restore_text() == PARAGRAPHS


def test_abbreviations_and_short_first_sentences_are_not_split_points():
    answer = ("Mr. Brown met Dr. Jones at the station. They talked for hours about trains.\n\n"
              "Ok. This paragraph has a first sentence that is too short to be a root.\n\n"
              "The meeting ended late in the evening. Both went home tired but happy.\n\n"
              "Trains were the topic of the whole day long. Nobody else came along.")
    e = extract(answer)
    assert e.kind == "paragraphs" and e.forks == 3
    assert e.tree.streams[0][0] == "Mr. Brown met Dr. Jones at the station."
    assert e.tree.restore_text() == answer


def test_too_few_paragraphs_or_forks_is_not_used():
    assert extract("One paragraph. With two sentences in it.").kind == "none"
    two = "First paragraph is here. It has more.\n\nSecond paragraph is here. It has more too."
    assert extract(two).kind == "none"
    singles = "Only one sentence here.\n\nAnd another one.\n\nAnd a third one."
    assert extract(singles).kind == "none"


@pytest.mark.parametrize("answer", [
    "Use this:\n```python\nprint('hi')\n```\nThat prints hi. It is simple. Really.",
    "Call `len(x)` to get the size. It works on lists. And strings.",
    "The answer is x = 5. Substitute back to check. Done.",
    "It costs $5. Cheap enough. Buy two.",
    "See https://example.com for details. It has more. Much more.",
    "Compute 12 x 34 first. Then add. Then stop.",
    "Use <b>bold</b> tags. They help. A lot.",
    "Part one\n---\nPart two",
])
def test_code_math_urls_and_markup_are_unstructured_negatives(answer):
    e = extract(answer)
    assert is_ambiguous(answer)
    assert e.kind == "unstructured" and not e.structured and e.forks == 0
    assert e.tree.streams == {0: [answer]}


def test_ranges_and_plain_numbers_are_not_math():
    assert not is_ambiguous("Sleep 7-9 hours, or 20-30 minutes for a nap, 24/7 if you can.")


def test_complete_part_drops_an_unfinished_tail():
    assert complete_part("Done. All of it.", finished=True) == "Done. All of it."
    assert complete_part("First point. Second point is cut mid", finished=False) == "First point."
    assert complete_part("1. A: one.\n2. B: two is cu", finished=False) == "1. A: one."
    assert complete_part("no end at all", finished=False) == ""


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(list("ab .:!?\n1234*-") + ["1. ", "\n\n", "Mr. ", ": ", "Word "]),
                max_size=120).map("".join))
def test_extraction_never_loses_a_character(answer):
    e = extract(answer)
    if e.tree is not None:
        assert e.tree.restore_text() == answer
        assert all(e.tree.own(t) for t in e.tree.threads[1:])  # no empty child


# ---------------------------------------------------------------------------------------------
# Control-token conventions
# ---------------------------------------------------------------------------------------------


class _Tok:
    def __init__(self, vocab):
        self._vocab = vocab

    def get_vocab(self):
        return dict(self._vocab)


def _base_vocab(n=10):
    return {f"t{i}": i for i in range(n)}


def test_official_apar_tokens_are_found_by_name():
    vocab = _base_vocab() | {"[SplitMask]": 10, "[SplitSop]": 11}
    found = find_control_tokens(_Tok(vocab), {"vocab_size": 12})
    assert (found.fork, found.child, found.convention) == (10, 11, "apar")
    assert found.names == ("[SplitMask]", "[SplitSop]")


def test_project_tokens_and_config_entry():
    vocab = _base_vocab() | {"[Fork]": 11, "[Child]": 10}
    found = find_control_tokens(_Tok(vocab), {})
    assert (found.fork, found.child, found.convention) == (11, 10, "project")
    # a config entry naming other tokens wins
    vocab |= {"<fk>": 12, "<ch>": 13}
    cfg = {"apar": {"convention": "project", "fork_token": "<fk>", "child_token": "<ch>"}}
    found = find_control_tokens(_Tok(vocab), cfg)
    assert (found.fork, found.child) == (12, 13)


def test_official_checkpoint_without_token_names_is_read_from_card_and_config(tmp_path: Path):
    vocab = _base_vocab(32000)
    assert find_control_tokens(_Tok(vocab), {"vocab_size": 32002}, tmp_path) is None  # no card
    (tmp_path / "README.md").write_text("# APAR-7B\nSee the APAR paper.")
    found = find_control_tokens(_Tok(vocab), {"vocab_size": 32002}, tmp_path)
    assert (found.fork, found.child, found.convention) == (32000, 32001, "apar")
    assert find_control_tokens(_Tok(vocab), {"vocab_size": 32000}, tmp_path) is None


def test_no_control_tokens():
    assert find_control_tokens(_Tok(_base_vocab()), {"vocab_size": 10}) is None
