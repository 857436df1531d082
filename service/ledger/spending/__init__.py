"""The spend transactions, split by concern (``service.ledger.reservations`` is the public API):

* ``requests``: parsed input and the operations (``Op``) it becomes;
* ``store``: persistence — loaded reservations, the locked ledger head (``Work``), the statements;
* ``answers``: the JSON answers, and an idempotent replay's answer;
* ``pre_pricing``: pricing of a spend before its transaction;
* ``decisions``: reserve, commit, abort and expire, decided on loaded state;
* ``engine``: group commit — group transactions, retries, ``Combiner`` and ``AsyncCombiner`` —
  which calls the decisions only through the ``Domain`` it is built with.

``ENGINE`` is the one engine of the process, built here once with its domain.
"""

from typing import Final

from service.ledger.spending import decisions, engine, pre_pricing

ENGINE: Final = engine.SpendEngine(
    engine.Domain(
        decide=decisions.decide,
        expire=decisions.expire,
        prepare=pre_pricing.prepare,
        prices_inline=pre_pricing.prices_inline,
    )
)
