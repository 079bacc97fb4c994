"""`slow`: runs CI adds after the suite (`make test-slow`); `make test` deselects them."""


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long property runs (10,000 hypothesis examples); make test-slow")
