"""Pure privacy mathematics: events, accountants, composition rules, certificates.

No I/O, no database, no web: numpy, scipy and prv-accountant only (a test enforces it).
"""
