"""The holder of the admin service's key file, writing the control log as ``gtm token create``
and the demo do (principal ``bootstrap``): operator overrides for tests that need a region
drained or forced without an admin API in between. Nodes verify its entries with the public
key (``document_keys=(holder.public,)``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from gtm.admin.signer import PRIVATE_NAME, PUBLIC_NAME, generate, load_signer
from gtm.control.entry import BOOTSTRAP
from gtm.control.log import ControlLog
from gtm.fleet import operator
from gtm.fleet.region_state import Override


class KeyHolder:
    def __init__(self, directory: Path) -> None:
        if not (directory / PRIVATE_NAME).exists():
            generate(directory)
        self.public = directory / PUBLIC_NAME
        key = load_signer(directory / PRIVATE_NAME)
        self.log = ControlLog({}, key, public=key.public_key())

    async def amend(self, engine: AsyncEngine, region: str, **change: Any) -> Override | None:
        await self.log.refresh(engine)
        return await operator.amend(engine, region, control=self.log, by=BOOTSTRAP, **change)

    async def clear(self, engine: AsyncEngine, region: str, **why: Any) -> bool:
        await self.log.refresh(engine)
        return await operator.clear(engine, region, control=self.log, by=BOOTSTRAP, **why)


__all__ = ["KeyHolder"]
