"""The graded tests' own marker for the part without a file of its own (the other parts' markers are in
pyproject.toml): exercise 11 grades exercises 1, 6 and 7 together in the engine."""


def pytest_configure(config):
    config.addinivalue_line("markers", "ex11: exercise 11, your engine: exercises 1, 6 and 7 together in the engine "
                                       "(tests/exercises/test_ex11_your_engine.py)")
