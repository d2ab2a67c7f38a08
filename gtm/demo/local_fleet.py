"""A local regional fleet for the demo and benchmarks: for every region of a topology whose
``base_url`` is on loopback, one simulated inference server and one regional balancer in front
of it, as separate processes (``regional-lb sim-backend`` and ``regional-lb serve``).

The balancer listens where the region's ``base_url`` says, so GTM's probes (``probe_url``) and
redirects reach it; its reports are signed with the secret given and pushed to ``gtm_urls``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import yaml

from gtm.decision.topology import Topology
from gtm.demo.ports import free_port
from regional_lb.capacity_report import region_secret

MODEL = "llama-3-8b"


@dataclass
class Fleet:
    directory: Path
    secret: str
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    balancers: dict[str, str] = field(default_factory=dict)  # region -> base URL
    _commands: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict)

    def start(
        self, topology: Topology, sim_port_base: int = 8700, gtm_urls: tuple[str, ...] = ()
    ) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for i, region in enumerate(topology.regions):
            # Each balancer holds only its own region's key, never the fleet's secret.
            key = region_secret(self.secret.encode(), region.id).decode()
            env = os.environ | {"REGIONAL_LB_REPORT_SECRET": key}
            url = urlsplit(str(region.base_url))
            if url.hostname != "127.0.0.1" or url.port is None:
                continue
            sim = f"127.0.0.1:{free_port(sim_port_base + i + 1)}"
            config = self.directory / f"{region.id}.yaml"
            config.write_text(
                yaml.safe_dump(
                    {
                        "region": region.id,
                        "listen": f"127.0.0.1:{url.port}",
                        "instances": [
                            {
                                "id": f"{region.id}-a100-1",
                                "url": f"http://{sim}",
                                "gpu": "A100",
                                "models": [MODEL],
                            }
                        ],
                        "gtm_urls": list(gtm_urls),  # where reports are pushed (GTM also probes)
                    }
                )
            )
            self._spawn(
                f"{region.id}-sim",
                [
                    "sim-backend",
                    "--listen",
                    sim,
                    "--gpu",
                    "A100",
                    "--models",
                    MODEL,
                    "--speedup",
                    "20",
                    "--seed",
                    str(i),
                ],
                env,
            )
            self._spawn(f"{region.id}-lb", ["serve", "--config", str(config), "--grace", "2"], env)
            self.balancers[region.id] = f"http://127.0.0.1:{url.port}"

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self._commands[name] = (args, env)
        log = (self.directory / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from regional_lb.cli import app; app(prog_name='regional-lb')",
                *args,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        # Twelve processes start at once: on a busy two-core machine that takes a minute.
        deadline = time.monotonic() + timeout_s
        pending = dict(self.balancers)
        while pending:
            # A process that exited (its port taken since it was chosen, say) is an error, not
            # a wait: another balancer answering on that port must not pass for ours.
            ended = sorted(n for n, p in self.processes.items() if p.poll() is not None)
            if ended:
                raise RuntimeError(
                    f"fleet processes exited: {', '.join(ended)} (logs in {self.directory})"
                )
            for region, base in list(pending.items()):
                try:
                    if httpx.get(f"{base}/gtm/capacity", timeout=1).status_code == 200:
                        del pending[region]
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"balancers not ready: {', '.join(sorted(pending))} (logs in {self.directory})"
                )
            time.sleep(0.2)

    def kill(self, name: str) -> None:
        proc = self.processes.get(name)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self, name: str) -> None:
        """Start a killed process again with its original command line."""
        self.kill(name)
        args, env = self._commands[name]
        self._spawn(name, args, env)

    def pause(self, name: str) -> None:
        """Freeze a process (SIGSTOP): its sockets stay open but nothing answers."""
        self.processes[name].send_signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.processes[name].send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for proc in self.processes.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
                proc.send_signal(signal.SIGTERM)
        for proc in self.processes.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
