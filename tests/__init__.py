"""The tests of the gateway, in tiers by what they need: unit/ (nothing), integration/ (real servers,
databases, brokers and worker processes), browser/ (Chromium), types/ (tsc); support/ and jobs/ are theirs.

Imported first by pytest and by every process of the tests' own (``python -m tests.support...``), so this is
where one thing is said for all of them: compiled modules are kept (in __pycache__, which git ignores) even
where the environment asks Python not to write them (PYTHONDONTWRITEBYTECODE). The suite starts several
processes of its own and hundreds of gateways, workers and clients, each of which would otherwise compile
every module of the gateway, and pytest would rewrite every test module's asserts again in each of its
processes (collecting took 13.6 s of CPU a process, 3.4 s with the compiled modules kept).
"""

import os
import sys

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
