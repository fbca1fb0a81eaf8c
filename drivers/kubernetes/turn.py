"""Catalogue runs take turns on a cluster, each holding a coordination.k8s.io/v1 Lease.

Each catalogue test expects every GPU of the cluster free, so a run holds the Lease
``gpu-sandbox-catalogue`` of the driver's namespace (``KubernetesDriver.catalogue_turn``)
while it runs the lane, and another run waits for it, up to
``GPU_SANDBOX_K8S_TURN_TIMEOUT_S`` (default 600 s). Nothing here is about GPUs or pods:
``CatalogueTurn`` takes any Lease for any holder.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, cast

from drivers.kubernetes.api import json_body, said
from gpuhost.errors import DriverError

if TYPE_CHECKING:
    from kubernetes.client import CoordinationV1Api

CATALOGUE_LEASE = "gpu-sandbox-catalogue"
"""The Lease a catalogue run holds while it runs the lane: one run at a time per cluster."""


def node_lease(node: str) -> str:
    """The Lease of the runs pinned to ``node``: a name of the API's rules (253 at most)."""
    name = f"{CATALOGUE_LEASE}-node-{node}"
    if len(name) <= 253:
        return name
    return f"{CATALOGUE_LEASE}-node-{hashlib.sha256(node.encode()).hexdigest()[:32]}"


TURN_DURATION_S = 15
"""How long a turn outlives its holder's last renewal (renewed every third of it): a run that
crashed gives its turn up by itself within 15 s, and a stall of seconds loses nothing."""
TURN_TIMEOUT_S = 600.0
"""How long a run waits for its turn: five lanes of the local cluster (119 s each), and below
the per-test bound (900 s), so that a wait given up on says whom it waited for."""
TURN_POLL_S = 0.5


def micro_time(at: datetime) -> str:
    """``at`` as a Lease's times are written, always with six digits of fraction.

    The client writes a datetime with ``isoformat()``, which leaves out a zero fraction, and
    the API server parses these times with the fraction required: never give it a zero one.
    """
    at = at.astimezone(UTC)
    return (at if at.microsecond else at.replace(microsecond=1)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class CatalogueTurn:
    """A catalogue run's turn on a cluster: a coordination.k8s.io/v1 Lease it holds.

    Entering takes the Lease: it creates it, or takes it over once it has no holder or has
    expired (not renewed for its ``leaseDurationSeconds`` by its ``renewTime``, or, whatever
    the clocks say, seen unchanged that long). While another run holds it, a line on stderr
    says who, and it waits, up to ``timeout_s`` (then ``TimeoutError``). A daemon thread
    renews it every third of ``duration_s``; exiting deletes it if it is still this run's,
    and raises ``DriverError`` if another run took it meanwhile (a renewal that could not
    reach the API server for a whole lease). Every write is conditional (a create fails when
    the Lease exists; a replace or a delete names the version it read), so two runs never
    both believe they hold it.
    """

    def __init__(
        self,
        api: CoordinationV1Api,
        namespace: str,
        name: str,
        identity: str,
        *,
        cluster: str,
        labels: Mapping[str, str] = MappingProxyType({}),
        duration_s: int = TURN_DURATION_S,
        timeout_s: float = TURN_TIMEOUT_S,
        poll_s: float = TURN_POLL_S,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.cluster = cluster
        self.duration_s = duration_s
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.labels = labels
        """The Lease's labels, as the run's other objects carry them."""
        self.lost: str | None = None
        """Who took the turn while this run held it; None while it is (or was) this run's."""
        self._held: dict[str, Any] | None = None
        self._seen: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._writing = threading.Lock()
        self._renewer: threading.Thread | None = None

    @property
    def lease(self) -> str:
        return f"{self.namespace}/{self.name}"

    def __enter__(self) -> None:
        started = time.monotonic()
        announced = ""
        while (holder := self._take()) is not None:
            if holder and holder != announced:
                _say(
                    f"waiting for another conformance run on cluster {self.cluster} "
                    f"(lease {self.name} held by {holder})"
                )
                announced = holder
            waited = time.monotonic() - started
            if waited >= self.timeout_s:
                raise TimeoutError(
                    f"gave up waiting for the catalogue turn on cluster {self.cluster} after "
                    f"{waited:.0f} s (GPU_SANDBOX_K8S_TURN_TIMEOUT_S): lease {self.lease} is "
                    f"held by {announced or 'another run'}. Hint: a run gives it back when its "
                    f"lane ends, and one that crashed within {self.duration_s} s; see kubectl "
                    f"get lease -n {self.namespace} {self.name} -o yaml"
                )
            time.sleep(self.poll_s)
        self._renewer = threading.Thread(
            target=self._renew_until_stopped, name=f"renew lease {self.lease}", daemon=True
        )
        self._renewer.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        with self._writing:  # no renewal once this is taken
            held, self._held = self._held, None
        if self._renewer is not None:
            self._renewer.join(timeout=self.duration_s)
        if held is not None:
            try:
                self._give_back()
            except Exception as error:  # it expires by itself; the lane's own error matters more
                _say(
                    f"could not give lease {self.lease} back ({said(error)}): it expires by "
                    f"itself within {self.duration_s} s"
                )
        if self.lost is not None and exc is None:
            raise DriverError(
                f"the catalogue turn on cluster {self.cluster} (lease {self.lease}) went to "
                f"{self.lost} while this run held it: another run may have used the cluster's "
                "GPUs at the same time"
            )

    # -- the Lease -----------------------------------------------------------------------

    def _read(self) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return cast(
                "dict[str, Any]",
                json_body(
                    self.api.read_namespaced_lease(
                        self.name,
                        self.namespace,
                        _preload_content=False,
                        _request_timeout=self.duration_s,
                    )
                ),
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _take(self) -> str | None:
        """Take the Lease if it is free; None once this run holds it, else its holder.

        "" when another run changed it between the read and the write: look again.
        """
        from kubernetes.client.exceptions import ApiException

        lease = self._read() or {}
        spec = lease.get("spec") or {}
        version = str((lease.get("metadata") or {}).get("resourceVersion") or "")
        holder = str(spec.get("holderIdentity") or "")
        taken_over = holder not in ("", self.identity)
        if taken_over and not self._expired(spec, version):
            return holder
        now = micro_time(datetime.now(UTC))
        body: dict[str, Any] = {
            "metadata": {"name": self.name, "labels": dict(self.labels)},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": self.duration_s,
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": int(spec.get("leaseTransitions") or 0) + taken_over,
            },
        }
        try:
            if not lease:
                made = self.api.create_namespaced_lease(
                    self.namespace, cast(Any, body), _preload_content=False
                )
            else:
                body["metadata"]["resourceVersion"] = version
                made = self.api.replace_namespaced_lease(
                    self.name, self.namespace, cast(Any, body), _preload_content=False
                )
        except ApiException as exc:
            if exc.status in (404, 409):  # made, taken or removed by another run just now
                return ""
            raise
        self._held = json_body(made)
        return None

    def _expired(self, spec: Mapping[str, Any], version: str) -> bool:
        duration = timedelta(seconds=int(spec.get("leaseDurationSeconds") or self.duration_s))
        renewed = spec.get("renewTime")
        if renewed and datetime.fromisoformat(renewed) + duration < datetime.now(UTC):
            return True
        # A holder whose clock runs ahead writes times in our future: a Lease seen unchanged
        # for its duration has expired, whatever it says.
        if self._seen is None or self._seen[0] != version:
            self._seen = (version, time.monotonic())
        return time.monotonic() - self._seen[1] > duration.total_seconds()

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(self.duration_s / 3):
            with self._writing:
                if self._held is None:
                    return
                try:
                    self._renew(self._held)
                except Exception:  # the API server away for a moment: the next round tries again
                    continue
                if self.lost is not None:
                    self._held = None
                    return

    def _renew(self, held: dict[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        body = {
            "metadata": {
                "name": self.name,
                "labels": held["metadata"].get("labels") or {},
                "resourceVersion": held["metadata"]["resourceVersion"],
            },
            "spec": {**held["spec"], "renewTime": micro_time(datetime.now(UTC))},
        }
        try:
            self._held = json_body(
                self.api.replace_namespaced_lease(
                    self.name,
                    self.namespace,
                    cast(Any, body),
                    _preload_content=False,
                    _request_timeout=self.duration_s / 3,
                )
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
            lease = self._read()
            holder = ((lease or {}).get("spec") or {}).get("holderIdentity")
            if lease is not None and holder == self.identity:
                self._held = lease  # written by a renewal whose answer was lost
            else:
                self.lost = str(holder or "nobody (it was deleted)")

    def _give_back(self) -> None:
        """Delete the Lease if it is still this run's (it names the version it read)."""
        from kubernetes.client.exceptions import ApiException

        for _ in range(3):
            lease = self._read()
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            precondition = {"resourceVersion": lease["metadata"]["resourceVersion"]}
            try:
                self.api.delete_namespaced_lease(
                    self.name,
                    self.namespace,
                    body=cast(Any, {"preconditions": precondition}),
                    _preload_content=False,
                )
                return
            except ApiException as exc:
                if exc.status == 404:
                    return
                if exc.status != 409:
                    raise


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")  # looked up late: pytest swaps sys.stderr
    sys.stderr.flush()
