"""``python -m gtm.demo [--once]``: what ``make demo`` runs."""

import asyncio
import sys

from gtm.demo.tour import main

asyncio.run(main(once="--once" in sys.argv[1:]))
