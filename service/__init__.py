"""privacy-ledger: the REST service, ledger operations, worker, dashboard and CLI around ``accountant``."""
