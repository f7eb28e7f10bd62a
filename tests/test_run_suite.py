"""tests/run_suite.py (what `make test` runs): which arguments after ``--`` are paths, and where
each path goes (the notebooks' process or the tests')."""

from run_suite import split_paths


def test_paths_go_to_their_side_and_options_stay_options():
    tests, labs, rest = split_paths(["-x", "tests/test_api.py::test_models_list", "labs/00_tour.ipynb",
                                     "-k", "tour", "-p", "no:cacheprovider", "tests"])
    assert tests == ["tests/test_api.py::test_models_list", "tests"]
    assert labs == ["labs/00_tour.ipynb"]
    assert rest == ["-x", "-k", "tour", "-p", "no:cacheprovider"]


def test_without_paths_everything_is_an_option():
    assert split_paths(["--durations=20", "-k", "no_such_path.py"]) == ([], [], ["--durations=20", "-k",
                                                                                "no_such_path.py"])
