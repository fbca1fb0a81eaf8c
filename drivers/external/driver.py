"""Mode ``templates``: a driver whose every operation runs one of a manifest's argv templates.

``Driver.create`` plans and (``allocation: host-registry``) leases as for any built-in
driver; ``start`` renders the create template with the leased GPUs' IDs and runs it. Every
command runs in a process group of its own, under the manifest's timeout, with a fixed
environment (``drivers.external.process``). A value that would begin a word of an argv
with ``-`` (an image ``--privileged``) is refused, naming its field, before anything is
leased or run (``drivers.external.templates.OptionLike``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Mapping

from drivers.base import Availability, Command, CommandTimedOut, Launch, Output, Sandbox
from drivers.external.adapter import ExternalDriver
from drivers.external.manifest import RESERVED_CONFIG_KEYS
from drivers.external.process import (
    PIPE,
    ExternalDriverError,
    checked,
    run_operation,
    spawn,
    terminate_group,
)
from drivers.external.stderr import says_gone, typed_error
from drivers.external.templates import (
    CreateRequest,
    OptionLike,
    RefusedValue,
    render,
    render_create,
)
from gpuhost.devices import CDI_KIND, GpuDevice
from gpuhost.errors import (
    InvalidDriverConfig,
    InvalidGpuRequest,
    SandboxExecError,
    SandboxStartError,
    shown,
)
from gpuhost.leases import Holder
from gpuhost.procfs import kill_marked
from gpuhost.spec import SHARED, DriverRequest, GpuPlan

DRY_RUN_ID = "0" * 12
"""The sandbox id of the create argv rendered at plan time, to check the request's values."""
CONFIG_TYPES: Mapping[str, type | tuple[type, ...]] = {
    "string": str, "integer": int, "boolean": bool, "list": list,
}  # fmt: skip


class TemplatesDriver(ExternalDriver):
    """An external driver of ``mode: templates``: each operation runs one of its argv templates."""

    def values(self, **more: str) -> dict[str, str]:
        """The variables every template may name, and ``more``."""
        kind = self.host.gpus[0].cdi_kind if self.host.gpus else CDI_KIND
        return {
            "session_id": self.session_id, "driver": self.name, "cdi_kind": kind, **more,
        }  # fmt: skip

    def operation(self, op: str, what: str, **more: str) -> subprocess.CompletedProcess[bytes]:
        """Run the template ``op`` with ``more`` variables, under its timeout."""
        try:
            argv = render(
                self.manifest.templates[op], self.values(**more), limits=self.manifest.limits
            )
        except RefusedValue as exc:
            raise ExternalDriverError(f"{self.name} {what}: {exc}") from exc
        return run_operation(argv, self.manifest.timeouts[op], f"{self.name} {what}", env=self.env)

    def ask_inventory(self) -> dict[str, tuple[str, ...]]:
        """The inventory template's lines: a UUID, then the IDs the driver names it by."""
        text = checked(self.operation("inventory", "inventory"), f"{self.name} inventory")
        found: dict[str, tuple[str, ...]] = {}
        for line in text.splitlines():
            if line.split():
                uuid, *ids = line.split()
                found[uuid] = tuple(ids) or (uuid,)
        return found

    # -- the create sequence's hooks -----------------------------------------------------

    def validate(self, request: DriverRequest) -> GpuPlan | None:
        for key, declared in self.manifest.driver_config.items():
            if key in request.config:
                value = request.config[key]
                kind = CONFIG_TYPES[declared.type]
                wrong_bool = isinstance(value, bool) and declared.type != "boolean"
                if wrong_bool or not isinstance(value, kind):
                    raise InvalidDriverConfig(
                        request.field(key), value,
                        f"{request.field(key)} must be a {declared.type}, got {shown(value)}",
                    )  # fmt: skip
        return super().validate(request)

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        """The contract's plan, then the create argv rendered dry: what it refuses, refused."""
        plan = super().plan(request)
        gpus = plan.gpus if plan is not None else ()
        self.create_argv(Launch(DRY_RUN_ID, request, plan, gpus, lambda holder: None))
        return plan

    def create_request(self, launch: Launch) -> CreateRequest:
        """The request in the templates' terms (``allocation`` decides whose devices)."""
        request, plan = launch.request, launch.plan
        nodes: tuple[tuple[str, str], ...] = ()
        mounts: tuple[tuple[str, str], ...] = ()
        if self.manifest.host_registry:
            # NVIDIA's devices by their first ID; AMD's and Intel's by their nodes when the
            # manifest has a dri_node fragment, as containers take them.
            devices = tuple(
                (self.device_ids(gpu)[0], gpu.uuid)
                for gpu in launch.gpus
                if gpu.vendor == "nvidia" or "dri_node" not in self.manifest.fragments
            )
            dri = [gpu for gpu in launch.gpus if gpu.vendor != "nvidia"]
            nodes = tuple(dict.fromkeys((n.path, str(n.source)) for g in dri for n in g.nodes))
            if dri and len(dri) == len(launch.gpus):
                mounts = tuple((str(src), target) for src, target in self.host.tool_mounts)
            gpu = None
        else:
            resolved = plan.gpus if plan is not None else ()
            devices = tuple(
                (device_id, resolved[i].uuid if i < len(resolved) else "")
                for i, device_id in enumerate(plan.device_ids if plan is not None else ())
            )
            gpu = plan.count if plan is not None and not plan.device_ids else None
        given = request.gpu.count if request.gpu is not None else None
        named = plan is not None and bool(plan.device_ids)
        count = len(devices) if devices else (plan.count if plan and given is not None else None)
        return CreateRequest(
            image=request.image or self.image or self.manifest.default_image or "",
            count=count,
            gpu=gpu,
            default_gpu=plan is not None and given is None and not named,
            devices=devices,
            dri_nodes=nodes if "dri_node" in self.manifest.fragments else (),
            tool_mounts=mounts,
            shared=plan is not None and plan.sharing == SHARED,
            env=dict(request.env),
            mig_profile=plan.mig_profile if plan is not None else None,
            vendor=plan.vendor if plan is not None else None,
            config={k: v for k, v in request.config.items() if k not in RESERVED_CONFIG_KEYS},
        )

    def create_argv(self, launch: Launch) -> list[str]:
        """The create template's argv; a value the CLI must not be given is refused.

        A value of the request, ``--image`` or the user's device IDs that would be read as an
        option, or that breaks the manifest's ``limits``, is an ``InvalidGpuRequest`` naming
        its field; one of the driver's own (an inventory's ID, a name made of the session
        id), a ``SandboxStartError``.
        """
        request = self.create_request(launch)
        try:
            return render_create(self.manifest, request, self.values(sandbox_id=launch.sandbox_id))
        except RefusedValue as exc:
            field = self.field_of(exc, launch)
            if not field:
                raise SandboxStartError(f"{self.name} create: {exc}") from exc
            error = (
                InvalidDriverConfig if field.startswith("template.driver_") else InvalidGpuRequest
            )
            problem = (
                f"must not begin with '-' where {self.name}'s create template puts it at the "
                f"start of an argv word ({shown(exc.element)}, before any '--'): the CLI would "
                "read it as an option"
                if isinstance(exc, OptionLike)
                else f"is refused by {self.name}'s limits: {exc}"
            )
            raise error(field, exc.value, f"{field} {problem}; got {shown(exc.value)}") from exc

    def field_of(self, exc: RefusedValue, launch: Launch) -> str:
        """The request's field (or option) that gave the refused value; "" for the driver's."""
        block = f"template.driver_config.{self.name}"
        fields = {
            "image": "template.image" if launch.request.image is not None else "--image",
            "env_key": "template.env",
            "env_value": f"template.env.{exc.item.get('env_key', '')}",
            "value": f"{block}.{exc.key}",
            "mig_profile": f"{block}.mig_profile",
            "vendor": f"{block}.vendor",
        }
        if not self.manifest.host_registry and launch.plan is not None:
            fields["device_id"] = launch.plan.field  # the user's own IDs, handed on as given
        return fields.get(exc.variable, "")

    def start(self, launch: Launch) -> Sandbox:
        sid = launch.sandbox_id
        argv = self.create_argv(launch)
        what = f"create of sandbox {sid}"
        data = self.stdin_request(launch) if self.manifest.request_on_stdin else None
        try:
            done = run_operation(argv, self.manifest.timeouts["create"], what, data, self.env)
            typed = typed_error(self.manifest.errors, done.stderr.decode(errors="replace"))
            if done.returncode != 0 and typed is not None:
                self._discard(sid, sid)
                raise typed
            out = checked(done, what)
        except ExternalDriverError as exc:
            self._discard(sid, sid)
            raise SandboxStartError(str(exc)) from exc
        native = out.strip().splitlines()[-1].strip() if out.strip() else ""
        if self.manifest.sandbox_id == "adapter":
            native = sid
        if not native or native.startswith("-"):
            self._discard(sid, sid)
            said = f"printed the id {shown(native)}" if native else "printed no sandbox id"
            raise SandboxStartError(f"{what}: {shown(argv)} {said} on stdout")
        try:
            holder = Holder.process(os.getpid())
            if "ready" in self.manifest.templates:
                checked(self.operation("ready", f"ready of {sid}", sandbox_id=sid, id=native), what)
            if "pid" in self.manifest.templates:
                done = self.operation("pid", f"pid of {sid}", sandbox_id=sid, id=native)
                text = checked(done, f"pid of {sid}").strip()
                if not text.isdigit():
                    raise ExternalDriverError(f"pid of {sid}: printed {shown(text)}, not a pid")
                holder = Holder.process(int(text))
        except (ExternalDriverError, OSError) as exc:
            self._discard(sid, native)
            raise SandboxStartError(str(exc)) from exc
        gpus = launch.gpus if self.manifest.host_registry else (
            launch.plan.gpus if launch.plan is not None else ()
        )  # fmt: skip
        return TemplatesSandbox(self, sid, native, gpus, holder)

    def stdin_request(self, launch: Launch) -> bytes:
        """The request as one JSON object (``requestOnStdin``), for create's stdin."""
        gpus = [
            {"uuid": gpu.uuid, "id": (self.device_ids(gpu) or (gpu.uuid,))[0]}
            for gpu in launch.gpus
        ]
        message = {
            "session_id": self.session_id, "sandbox_id": launch.sandbox_id,
            "driver": self.name, "request": launch.request.to_spec().to_dict(), "gpus": gpus,
        }  # fmt: skip
        return json.dumps(message).encode() + b"\n"

    def _discard(self, sandbox_id: str, native: str) -> None:
        """Close what a failed create may have left; its own failure is not the story."""
        with contextlib.suppress(ExternalDriverError):
            self.operation("close", f"close of {sandbox_id}", sandbox_id=sandbox_id, id=native)

    # -- the rest of the contract -----------------------------------------------------------

    def probe(self) -> Availability:
        program = self.manifest.templates["create"][0]
        path = self.env["PATH"]
        if shutil.which(program, path=path) is None:
            return Availability(False, f"needed {program} on PATH (found none in {path})")
        try:
            self.sandboxes(self.session_id)
        except ExternalDriverError as exc:
            return Availability(False, f"needed the list template to answer (found: {exc})")
        return Availability(True)

    def sandboxes(self, session_id: str) -> list[str]:
        done = self.operation("list", "list", session_id=session_id)
        text = checked(done, f"{self.name} list of session {session_id}")
        return sorted({line.strip() for line in text.splitlines() if line.strip()})

    def reap_once(self, session_id: str) -> None:
        """Ask the driver once to remove everything of ``session_id``.

        Without a reap template (``sandboxId: adapter``): close each sandbox list prints.
        """
        if "reap" not in self.manifest.templates:
            for sid in self.sandboxes(session_id):
                done = self.operation(
                    "close", f"close of {sid}", session_id=session_id, sandbox_id=sid, id=sid
                )
                self.gone(done, f"{self.name} reap of {session_id}: close of {sid}")
            return
        done = self.operation("reap", "reap", session_id=session_id)
        checked(done, f"{self.name} reap of {session_id}")

    def gone(self, done: subprocess.CompletedProcess[bytes], what: str) -> None:
        """A close or kill succeeded, or failed saying the sandbox is gone (``SandboxGone``)."""
        if done.returncode != 0 and says_gone(
            self.manifest.errors, done.stderr.decode("utf-8", "replace")
        ):
            return
        checked(done, what)

    def version(self) -> str:
        if "version" not in self.manifest.templates:
            return ""
        text = checked(self.operation("version", "version"), f"{self.name} version")
        return text.strip().splitlines()[0] if text.strip() else ""


class TemplatesSandbox(Sandbox):
    """A sandbox of an external driver: ``native_id`` is the driver's own id (``{id}``)."""

    def __init__(
        self, adapter: TemplatesDriver, sandbox_id: str, native_id: str,
        gpus: tuple[GpuDevice, ...], holder: Holder,
    ) -> None:  # fmt: skip
        leases = adapter.host.leases if adapter.manifest.host_registry else None
        super().__init__(sandbox_id, adapter.name, gpus, holder, leases)
        self.native_id = native_id
        self._adapter = adapter

    def values(self) -> dict[str, str]:
        return self._adapter.values(sandbox_id=self.id, id=self.native_id)

    def exec_argv(self, command: Command) -> list[str]:
        manifest = self._adapter.manifest
        env = tuple({"env_key": k, "env_value": v} for k, v in command.env.items())
        try:
            argv = render(
                manifest.templates["exec"], self.values(), {"env": env}, manifest.fragments,
                limits=manifest.limits,
            )  # fmt: skip
        except RefusedValue as exc:
            raise SandboxExecError(f"{self.driver}'s exec in {self.id}: {exc}") from exc
        return [*argv, *command.argv]

    def run(self, command: Command, output: Output) -> int:
        argv = self.exec_argv(command)
        fds = output.fds or (PIPE, PIPE)
        try:
            # The marker in the CLI's own environment too: a timeout finds it on this host.
            process = spawn(argv, {**self._adapter.env, **command.env}, *fds)
        except OSError as exc:
            raise SandboxExecError(f"cannot run {shown(argv)}: {exc}") from exc
        try:
            output.read_from(process, command.timeout)
        except subprocess.TimeoutExpired:
            kill_marked(command.needle)
            terminate_group(process)
            raise CommandTimedOut from None
        finally:
            for pipe in (process.stdout, process.stderr):
                if pipe is not None:
                    pipe.close()
        if process.returncode in self._adapter.manifest.driver_error_codes:
            said = output.kept()[1][-4096:].decode(errors="replace").strip()  # its end says why
            raise SandboxExecError(
                f"{self.driver}'s exec {shown(argv)} failed with its own exit code "
                f"{process.returncode} (the manifest's driverErrorCodes): {said}"
            )
        if process.returncode < 0:
            raise SandboxExecError(
                f"{self.driver}'s exec {shown(argv)} was killed by signal {-process.returncode}"
            )
        return process.returncode

    def stop(self) -> None:
        done = self._adapter.operation("close", f"close of {self.id}", **self.values())
        self._adapter.gone(done, f"{self.driver} close of {self.id}")

    def kill(self) -> None:
        if "kill" in self._adapter.manifest.templates:
            done = self._adapter.operation("kill", f"kill of {self.id}", **self.values())
            self._adapter.gone(done, f"{self.driver} kill of {self.id}")
        else:
            self.stop()
