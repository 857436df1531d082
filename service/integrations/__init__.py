"""Adapters for the tools trainers already use: Opacus (``opacus``), dp-accounting
(``dp_accounting``), MLflow (``mlflow``). Each imports its library, which the core service never
needs: nothing in ``service`` imports this package (``pip install "privacy-ledger[opacus]"``,
``[mlflow]``)."""
