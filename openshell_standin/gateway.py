"""The stand-in gateway's RPCs: OpenShell's API as its generated code has it, over grpcio.

It serves the RPCs OpenShell's CLI (v0.0.111) calls for ``sandbox create`` (CreateSandbox,
then WatchSandbox until the sandbox is Ready: crates/openshell-cli/src/run.rs:417-700),
``sandbox exec`` (GetSandbox, ExecSandbox: run.rs:1399-1516), ``sandbox get``, ``list``
(ListSandboxes: run.rs:1959-1990) and ``delete`` (DeleteSandbox: run.rs:2348-2410); every
other RPC is the generated code's own UNIMPLEMENTED.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from concurrent import futures
from typing import Any

import grpc  # type: ignore[import-untyped]
from google.protobuf import json_format  # type: ignore[import-untyped]

from drivers.reference import ReferenceDriver
from openshell_standin import rules
from openshell_standin.rules import Refused
from openshell_standin.sandboxes import ERROR, READY, Record, Request, Sandboxes
from openshell_standin.stubs import Api
from openshell_standin.tls import HOST, Materials

SERVED = ("CreateSandbox", "GetSandbox", "ListSandboxes", "DeleteSandbox", "WatchSandbox",
          "ExecSandbox")  # fmt: skip
WORKSPACE = "default"
WORKERS = 32
"""Each watch and exec holds a worker while it streams."""


class Gateway:
    """OpenShell's gateway as far as the CLI's sandbox commands go, over the reference driver.

    ``driver`` is the compute driver it stands in for: the one whose block of
    ``template.driver_config`` it reads (docker or podman: ``cdi_devices``).
    """

    def __init__(self, api: Api, reference: ReferenceDriver, driver: str = "docker") -> None:
        if driver not in rules.DRIVER_KEYS:
            known = ", ".join(rules.DRIVER_KEYS)
            raise ValueError(f"unknown compute driver {driver!r}; known: {known}")
        self.api = api
        self.driver = driver
        self.sandboxes = Sandboxes(reference)

    def servicer(self) -> Any:
        """The generated servicer, with this gateway's handlers for the RPCs it serves."""
        servicer = self.api.services.OpenShellServicer()
        for name in SERVED:
            setattr(servicer, name, getattr(self, name))
        return servicer

    # -- RPCs --------------------------------------------------------------------------

    def CreateSandbox(self, request: Any, context: Any) -> Any:
        with _answered(context):
            record = self.sandboxes.create(self._request(request))
            # server/grpc/sandbox.rs:311: the answer is the sandbox as persisted, Provisioning.
            message = self._message(record, provisioning=True)
            return self.api.messages.SandboxResponse(sandbox=message)

    def GetSandbox(self, request: Any, context: Any) -> Any:
        with _answered(context):
            if not request.name:
                raise rules.invalid("name is required")  # server/grpc/sandbox.rs:377-379
            _check_workspace(request.workspace)
            record = self.sandboxes.by_name(request.name)
            return self.api.messages.SandboxResponse(sandbox=self._message(record))

    def ListSandboxes(self, request: Any, context: Any) -> Any:
        with _answered(context):
            # server/grpc/sandbox.rs:404-468
            if request.all_workspaces and request.workspace:
                raise rules.invalid("all_workspaces and workspace are mutually exclusive")
            if not request.all_workspaces:
                _check_workspace(request.workspace)
            pairs = rules.parse_selector(request.label_selector)
            chosen = [
                r for r in self.sandboxes.listed() if all(r.labels.get(k) == v for k, v in pairs)
            ]
            page = chosen[request.offset : request.offset + rules.clamp_limit(request.limit)]
            return self.api.messages.ListSandboxesResponse(
                sandboxes=[self._message(r) for r in page]
            )

    def DeleteSandbox(self, request: Any, context: Any) -> Any:
        with _answered(context):
            if not request.name:
                raise rules.invalid("name is required")  # server/grpc/sandbox.rs:760-762
            _check_workspace(request.workspace)
            # server/compute/mod.rs:1448-1453: an unknown name is NotFound.
            self.sandboxes.delete(request.name)
            return self.api.messages.DeleteSandboxResponse(deleted=True)

    def WatchSandbox(self, request: Any, context: Any) -> Iterator[Any]:
        with _answered(context):
            if not request.id:
                raise rules.invalid("id is required")  # server/grpc/sandbox.rs:938-940
            record = self.sandboxes.by_id(request.id)
        # server/grpc/sandbox.rs:990-1015: the snapshot now, then each change.
        for _ in self.sandboxes.snapshots(record, context.is_active):
            message = self._message(record)
            yield self.api.messages.SandboxStreamEvent(sandbox=message)
            if request.stop_on_terminal and record.phase == READY:
                return

    def ExecSandbox(self, request: Any, context: Any) -> Iterator[Any]:
        messages = self.api.messages
        with _answered(context):
            if not request.sandbox_id:
                raise rules.invalid("sandbox_id is required")  # server/grpc/sandbox.rs:1180-1185
            environment = dict(request.environment)
            rules.check_exec(request.command, environment, request.workdir)
            record = self.sandboxes.by_id(request.sandbox_id)
            if record.phase != READY:
                raise Refused("FAILED_PRECONDITION", "sandbox is not ready")
            if request.stdin or request.tty:
                raise Refused(
                    "UNIMPLEMENTED", "the stand-in gateway passes no stdin and no terminal"
                )
            line = rules.remote_command(request.command, environment, request.workdir)
            line = self.sandboxes.login_path() + line
            events = self.sandboxes.exec(
                record, ["/bin/bash", "-lc", line], request.timeout_seconds, context.is_active
            )
            for stream, data in events:
                if stream == "stdout":
                    yield messages.ExecSandboxEvent(stdout=messages.ExecSandboxStdout(data=data))
                elif stream == "stderr":
                    yield messages.ExecSandboxEvent(stderr=messages.ExecSandboxStderr(data=data))
                else:
                    yield messages.ExecSandboxEvent(exit=messages.ExecSandboxExit(exit_code=data))

    # -- requests and answers ----------------------------------------------------------

    def _request(self, request: Any) -> Request:
        """A CreateSandbox request judged as the gateway does (server/grpc/sandbox.rs:213-330)."""
        if not request.HasField("spec"):
            raise rules.invalid("spec is required")
        spec = request.spec
        command = tuple(spec.command) or rules.DEFAULT_COMMAND
        rules.check_name(request.name)
        environment = dict(spec.environment)
        rules.check_environment(environment, "spec.environment")
        template = spec.template
        config: Mapping[str, Any] | None = None
        if spec.HasField("template"):
            rules.check_template(template.image, dict(template.environment),
                                 template.driver_config.ByteSize())  # fmt: skip
            if template.HasField("driver_config"):
                config = json_format.MessageToDict(template.driver_config)
        requirements = spec.resource_requirements
        gpu = spec.HasField("resource_requirements") and requirements.HasField("gpu")
        count = requirements.gpu.count if gpu and requirements.gpu.HasField("count") else None
        if count == 0:
            raise rules.invalid("gpu count must be greater than 0")  # validation.rs:247-252
        rules.check_main_command(command)
        rules.check_labels(dict(request.labels))
        for key in request.annotations:
            rules.check_label_key(key)
        _check_workspace(request.workspace)
        for provider in spec.providers:  # server/grpc/sandbox.rs:259-267: none exists here
            raise Refused("FAILED_PRECONDITION", f"provider '{provider}' not found")
        block = rules.read_block(rules.select_block(config, self.driver), self.driver)
        rules.effective_gpu_count(gpu, count)  # docker/lib.rs:575-592
        rules.check_exact_devices(gpu, count, block)
        stored = self.api.messages.SandboxSpec()
        stored.CopyFrom(spec)
        stored.command[:] = list(command)
        if not stored.template.image:
            stored.template.image = rules.DEFAULT_IMAGE  # server/grpc/sandbox.rs:272-276
        return Request(
            name=request.name or _generated_name(),
            labels=dict(request.labels),
            command=command,
            env={**dict(template.environment), **environment},
            gpu=gpu,
            count=count,
            device_ids=block.device_ids,
            spec=stored,
        )

    def _message(self, record: Record, provisioning: bool = False) -> Any:
        """The public ``Sandbox`` message of ``record``."""
        messages = self.api.messages
        phase = "SANDBOX_PHASE_PROVISIONING" if provisioning else {
            READY: "SANDBOX_PHASE_READY", ERROR: "SANDBOX_PHASE_ERROR"}[record.phase]  # fmt: skip
        status = messages.SandboxStatus(sandbox_name=record.name, phase=getattr(messages, phase))
        if record.phase == ERROR and not provisioning:
            # server/compute/mod.rs:3318-3338
            status.exit_code = record.exit_code
            status.conditions.append(messages.SandboxCondition(
                type="Ready", status="False", reason="MainProcessExited",
                message="Canonical main process exited"))  # fmt: skip
        elif not provisioning:
            status.conditions.append(messages.SandboxCondition(
                type="Ready", status="True", reason="Running",
                message="the stand-in's reference sandbox runs"))  # fmt: skip
        metadata = self.api.datamodel.ObjectMeta(
            id=record.id, name=record.name, created_at_ms=record.created_ms,
            labels=record.labels, resource_version=record.version, workspace=WORKSPACE,
        )  # fmt: skip
        return messages.Sandbox(metadata=metadata, spec=record.spec, status=status)

    def close(self) -> None:
        self.sandboxes.close()


class _answered:
    """Turns ``Refused`` into the gRPC status it names (``context.abort`` raises)."""

    def __init__(self, context: Any) -> None:
        self.context = context

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, Refused):
            self.context.abort(getattr(grpc.StatusCode, exc.code), exc.message)


def _check_workspace(workspace: str) -> None:
    """The stand-in has one workspace: ``default``, which empty means."""
    if workspace not in ("", WORKSPACE):
        raise Refused("NOT_FOUND", f"workspace '{workspace}' not found")


def _generated_name() -> str:
    """A name for a create that gives none: 19 bytes at most (server/grpc/sandbox.rs:144-149)."""
    return f"sandbox-{uuid.uuid4().hex[:11]}"


def serve(gateway: Gateway, materials: Materials, port: int = 0) -> tuple[Any, int]:
    """Serve ``gateway`` on 127.0.0.1 with mutual TLS; the started server and its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS))
    gateway.api.services.add_OpenShellServicer_to_server(gateway.servicer(), server)
    credentials = grpc.ssl_server_credentials(
        [(materials.server_key, materials.server_cert)],
        root_certificates=materials.ca,
        require_client_auth=True,
    )
    bound = server.add_secure_port(f"{HOST}:{port}", credentials)
    if not bound:
        raise RuntimeError(f"cannot listen on {HOST}:{port}")
    server.start()
    return server, bound
