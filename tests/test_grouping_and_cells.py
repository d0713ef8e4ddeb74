from dtlab.analysis.grouping import group_by_value
from dtlab.records import CellOutput
from dtlab.views.cells import collate, collate_cell


def test_group_by_value_orders_groups_by_first_rank():
    assert group_by_value({2: "b", 0: "a", 1: "a", 3: "b", 4: "c"}) == [
        ((0, 1), "a"),
        ((2, 3), "b"),
        ((4,), "c"),
    ]


def test_identical_outputs_print_once():
    text = collate({r: "hello\n" for r in range(8)})
    assert text == "ranks 0-7: hello\n"


def test_different_outputs_each_labelled_and_silent_ranks_left_out():
    text = collate({0: "a\n", 1: "b\n", 2: "a\n", 3: ""})
    assert text == "ranks 0,2: a\nrank 1: b\n"


def test_multiline_output_goes_under_its_label():
    text = collate({0: "x\ny\n", 1: "x\ny\n"})
    assert text == "ranks 0-1:\nx\ny\n"


def test_collate_cell_separates_streams_and_results():
    outs = {
        0: CellOutput(stdout="hi\n", stderr="warn\n", result="0"),
        1: CellOutput(stdout="hi\n", result="1"),
    }
    stdout, stderr, results = collate_cell(outs)
    assert stdout == "ranks 0-1: hi\n"
    assert stderr == "rank 0: warn\n"
    assert results == "Out[rank 0]: 0\nOut[rank 1]: 1\n"
