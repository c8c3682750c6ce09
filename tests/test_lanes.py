"""The suite's own order and lanes (tests/conftest.py): every prefix of FIRST and PACED names a collected test (a
renamed test cannot drop silently out of the lane of tests that mostly wait), and the lanes' scheduler hands the
paced tests to one worker as one unit and every other test out on its own."""
import pytest

import conftest

PACED_TEST = "tests/test_ft_run.py::test_commlab_fault_says_which_flags_go_together"


def test_a_prefix_that_names_no_test_is_found():
    ids = [PACED_TEST, "tests/test_ft_cut.py::test_show_says_the_cut", "tests/test_lab.py::test_x"]
    gone = conftest.unmatched(ids)
    assert "tests/test_ft_run.py::" not in gone and "tests/test_ft_cut.py::" not in gone  # matched
    assert not [p for p in gone if p.startswith("tests/test_lab.py")]  # a file collected with no prefix of its own
    renamed = conftest.unmatched(["tests/test_safe_room.py::test_a_preview_child_is_stopped_at_its_limit[naps]",
                                  "tests/test_safe_room.py::test_children_are_bounded_per_person_and_per_server"])
    assert renamed == ["tests/test_safe_room.py::test_a_preview_child_is_stopped_at_its_limit[sleeps]"]
    assert conftest.unmatched(["test_ft_cut.py::test_show_says_the_cut"]) == []  # ids relative to tests/ too


def test_every_prefix_names_a_collected_test(request):
    """This session's collection: the whole suite when the suite runs."""
    config = request.config
    if config.getoption("keyword") or config.getoption("markexpr") or any("::" in a for a in config.args):
        pytest.skip("this session collected only some of its files' tests")
    assert conftest.unmatched(item.nodeid for item in request.session.items) == []


class Node:
    def __init__(self, name):
        self.gateway, self.shutting_down, self.sent = type("G", (), {"id": name})(), False, []

    def send_runtest_some(self, indices):
        self.sent += indices

    def shutdown(self):
        self.shutting_down = True


class Quiet:
    """xdist's log, silent."""

    def __getattr__(self, name):
        return self

    def __call__(self, *args):
        pass


class Config:
    def getvalue(self, name):
        return {"dist": "loadgroup", "tx": ["3*popen"]}[name]

    class option:
        loadscopereorder = True


def test_the_paced_tests_go_to_one_worker_as_one_unit_and_the_others_one_by_one():
    others = [f"tests/test_lab.py::test_{i}" for i in range(20)]
    paced = [PACED_TEST, "tests/test_ft_cut.py::test_show_says_the_cut", conftest.PACED[0]]
    collection = others[:5] + paced[:1] + others[5:] + paced[1:]
    sched = conftest.pytest_xdist_make_scheduler(Config(), Quiet())
    nodes = [Node(f"gw{i}") for i in range(3)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    got = [[collection[i] for i in node.sent] for node in nodes]
    assert sorted(got[0]) == sorted(paced)  # the largest unit first: all of PACED, and nothing else yet
    assert [len(g) for g in got[1:]] == [2, 2] and not set(got[1] + got[2]) & set(paced)  # a test at a time
    assert sorted(got[1] + got[2], key=collection.index) == others[:4]  # the first in the collection
    for test in got[1]:  # worker 1 finishes its tests: it is given more of the others, never a paced one
        sched.mark_test_complete(nodes[1], collection.index(test))
    assert len(nodes[1].sent) > 2 and not {collection[i] for i in nodes[1].sent} & set(paced)


def test_another_dist_is_xdists_own():
    class Load(Config):
        def getvalue(self, name):
            return "load"
    assert conftest.pytest_xdist_make_scheduler(Load(), Quiet()) is None
