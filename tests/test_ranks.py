import pytest

from dtlab.analysis.ranks import format_ranks, label_ranks, parse_rank_spec


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("all", (0, 1, 2, 3, 4, 5, 6, 7)),
        ("even", (0, 2, 4, 6)),
        ("odd", (1, 3, 5, 7)),
        ("0,3", (0, 3)),
        ("0-3", (0, 1, 2, 3)),
        ("1,4-6", (1, 4, 5, 6)),
        (" 3 , 1 ", (1, 3)),
        ("2,2,1-2", (1, 2)),
        ("ALL", tuple(range(8))),
    ],
)
def test_parse_rank_spec(spec, expected):
    assert parse_rank_spec(spec, 8) == expected


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("8", "rank 8 in '8' does not exist: valid ranks are 0-7"),
        ("0-9", "rank 9"),
        ("a", "'a' is not a rank"),
        ("1-", "'1-' is not a rank"),
        ("-1", "'-1' is not a rank"),
        ("3-1", "write it low-high"),
        ("", "is not a rank"),
    ],
)
def test_parse_rank_spec_rejects_with_reason(spec, fragment):
    with pytest.raises(ValueError) as e:
        parse_rank_spec(spec, 8)
    assert fragment in str(e.value)


def test_single_rank_world_message():
    with pytest.raises(ValueError, match="the only rank is 0"):
        parse_rank_spec("1", 1)


@pytest.mark.parametrize(
    "ranks, text",
    [([0, 1, 2, 3, 5], "0-3,5"), ([7], "7"), ([3, 1, 2], "1-3"), ([0, 2, 4], "0,2,4"), ([], "")],
)
def test_format_ranks(ranks, text):
    assert format_ranks(ranks) == text


def test_label_ranks_singular_and_plural():
    assert label_ranks([3]) == "rank 3"
    assert label_ranks([0, 1, 2, 3, 4, 5, 6, 7]) == "ranks 0-7"


def test_label_of_no_ranks():
    assert label_ranks([]) == "no rank"
