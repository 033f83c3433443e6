"""What the config makes of the gateway (SPEC §2, §8, §10 P6): served models and their
routes, the supervisor of each process, what each process asks of the memory pools, what
a pause stops.

`build()` derives all of it from a config in one pass. A config reload builds a new
`Topology` and the gateway swaps it in as a whole; the supervisor of a backend whose spec
is unchanged is carried over (so its process keeps serving), every other supervisor is
new. Making a supervisor is the caller's (`make`), so this module does no I/O and the
long-lived owners (admission, residency, pauses, the ledger) stay outside it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from corrallm.config import Config, backend_id
from corrallm.config.schema import ANY_GPU, BackendConfig, ModelConfig, ProcessSpec
from corrallm.lifecycle.addresses import resolve_url
from corrallm.lifecycle.pauses import Kind, Pausable
from corrallm.lifecycle.remote import RemoteEndpoint
from corrallm.lifecycle.supervisor import Supervisor
from corrallm.peers.catalog import PeerView, RemoteModel
from corrallm.peers.nodes import Nodes
from corrallm.residency.footprints import Footprint
from corrallm.residency.manager import Tenancy
from corrallm.routing.filters import filters_of
from corrallm.routing.router import Endpoint, Route, ServedModel

EVICT_COSTS = ["low", "medium", "high"]

# (backend id, its spec) -> a new supervisor for it
MakeSupervisor = Callable[[str, ProcessSpec], Supervisor]
# (backend id, model name, model, backend) -> the endpoint its route reaches
EndpointOf = Callable[[str, str, ModelConfig, BackendConfig], Endpoint]


@dataclass
class Topology:
    config: Config
    supervisors: dict[str, Supervisor] = field(default_factory=dict)  # every process
    extensions: dict[str, Supervisor] = field(default_factory=dict)
    routes: dict[str, Route] = field(default_factory=dict)
    models: dict[str, ServedModel] = field(default_factory=dict)  # by name and by alias
    served: list[ServedModel] = field(default_factory=list)  # each once, in config order
    tenancies: list[Tenancy] = field(default_factory=list)

    def hosted_by(self, extension: str) -> list[ModelConfig]:
        return [
            m
            for m in self.config.models.values()
            if any(b.extension == extension for b in m.backends)
        ]

    def own_supervisors(self, served: ServedModel) -> list[Supervisor]:
        """The processes a model alone owns (not the extensions it shares with others)."""
        return [
            self.supervisors[r.id]
            for r in served.routes
            if not r.config.extension and r.id in self.supervisors
        ]

    def pausables(self) -> dict[tuple[Kind, str], Pausable]:
        targets: dict[tuple[Kind, str], Pausable] = {}
        for served in self.served:
            targets[("model", served.name)] = Pausable(
                "model", served.name, self.own_supervisors(served), served.config.persistent
            )
        for name, sup in self.extensions.items():
            pinned = any(m.persistent for m in self.hosted_by(name))
            targets[("extension", name)] = Pausable("extension", name, [sup], pinned)
        return targets

    def models_of(self, sup: Supervisor) -> list[str]:
        return sorted({r.model for r in self.routes.values() if r.endpoint is sup})


def build(
    config: Config,
    make: MakeSupervisor,
    previous: Mapping[str, Supervisor] | None = None,
    footprints: Mapping[str, Footprint] | None = None,
    nodes: Nodes | None = None,
) -> Topology:
    """The topology of `config`, keeping the supervisor of every unchanged process;
    `footprints` are the estimates of backends whose ramUsage is auto or omitted (M1);
    `nodes`: the peers whose models join the local ones as `<model>@<peer>` (X1)."""
    kept = previous or {}
    estimated = footprints or {}
    topo = Topology(config)

    def supervisor(sid: str, spec: ProcessSpec) -> Supervisor:
        sup = kept.get(sid)
        if sup is None or sup.spec != spec or sup.retired:
            sup = make(sid, spec)
        topo.supervisors[sid] = sup
        return sup

    for name, spec in config.extensions.items():
        topo.extensions[name] = supervisor(f"extension:{name}", spec)
    remote = _remote_models(config, nodes)
    models = dict(config.models)
    for name, found in remote.items():
        models[name] = _with_peers(config, models.get(name), found)

    def endpoint_of(bid: str, name: str, model: ModelConfig, backend: BackendConfig) -> Endpoint:
        if backend.peer is not None:
            assert nodes is not None
            return nodes.endpoint(backend.peer, name)
        if backend.extension:
            return topo.extensions[backend.extension]
        if backend.cmd or backend.supervision in ("docker", "systemd"):
            sup = supervisor(bid, backend)
            topo.tenancies.append(_tenancy(config, sup, backend, [model], estimated.get(bid)))
            return sup
        assert backend.proxy is not None, "validated config"
        return RemoteEndpoint(bid, resolve_url(backend.proxy, None))

    for name, model in models.items():
        serve(topo, name, model, endpoint_of)
    if nodes is not None:
        nodes.kept({r.id for r in topo.routes.values()})
    for name, sup in topo.extensions.items():
        spec = config.extensions[name]
        footprint = estimated.get(sup.id)
        topo.tenancies.append(_tenancy(config, sup, spec, topo.hosted_by(name), footprint))
    return topo


def serve(
    topo: Topology,
    name: str,
    model: ModelConfig,
    endpoint_of: EndpointOf,
) -> ServedModel:
    """Add the model `name` to the topology: a route to each of its backends (their ids
    as `backend_id` names them), reaching each through `endpoint_of`'s endpoint. A
    relaying worker builds its topology with this too, its endpoints mirrors of the
    owner's (corrallm/workers/mirror.py)."""
    filters = filters_of(model)  # K5: its filters, and alias -> its own setParams
    routes = []
    index = 0  # a local backend's `#index` counts local ones only: peers never shift it
    for backend in model.backends:
        bid = backend_id(name, index, backend)
        index += backend.peer is None
        route = Route(bid, name, backend, endpoint_of(bid, name, model, backend), filters)
        routes.append(route)
        topo.routes[bid] = route
    served = ServedModel(name, model, routes)
    topo.served.append(served)
    for key in (name, *model.aliases):
        topo.models.setdefault(key, served)  # a local name wins over a peer's alias
    return served


def _tenancy(
    config: Config,
    sup: Supervisor,
    spec: ProcessSpec,
    models: list[ModelConfig],
    footprint: Footprint | None,
) -> Tenancy:
    """What the process asks of its server's pools (R1, M1) and how it idles out (R4);
    pinned if any model it serves is. Without a server or a footprint (declared or
    estimated) it takes no room but still expires by its sticky.ttl."""
    server = spec.server or (next(iter(config.servers)) if config.servers else None)
    estimated = footprint.usage if footprint is not None else None
    wanted = spec.declared if spec.declared is not None else estimated
    if not wanted:
        server = None
    gpus = config.servers[server].gpus if server and ANY_GPU in (wanted or {}) else []
    stickies = [m.sticky for m in models]
    ttls = [s.ttl for s in stickies if s is not None and s.ttl is not None]
    costs = [s.evict_cost for s in stickies if s is not None]
    sup.keep_alive = any(m.persistent for m in models)  # M4: restarted after it fails
    return Tenancy(
        sup,
        server,
        declared=spec.declared,
        estimated=estimated,
        pinned=any(m.persistent for m in models),
        # An extension expires only once every model it hosts would.
        ttl=max(ttls) if ttls and len(ttls) == len(models) else None,
        evict_cost=max(costs, key=EVICT_COSTS.index, default="medium"),
        gpus=tuple(gpus),
        sleep_usage=dict(spec.sleep_usage) if spec.sleep is not None else None,
    )


def _remote_models(
    config: Config, nodes: Nodes | None
) -> dict[str, list[tuple[PeerView, RemoteModel]]]:
    """Each model some peer serves: [(peer, what it serves)], peers in config order."""
    found: dict[str, list[tuple[PeerView, RemoteModel]]] = {}
    if nodes is None:
        return found
    for view in (nodes.views[peer] for peer in config.peers if peer in nodes.views):
        for remote in view.models.values():
            found.setdefault(remote.name, []).append((view, remote))
    return found


def _with_peers(
    config: Config, local: ModelConfig | None, found: list[tuple[PeerView, RemoteModel]]
) -> ModelConfig:
    """The model with its peers' backends (X1): each after the local backends of its type
    and quality (before them with `peerOrder: first`), else after all of them. A model
    served only by peers takes the first peer's aliases."""
    backends = list(local.backends) if local is not None else []
    first = config.peer_order == "first"
    for view, remote in found:
        b = remote.primary
        backend = BackendConfig(
            name=f"{remote.name}@{view.name}",
            proxy=view.url,
            model=remote.name,  # a caller may have named a local alias
            type=b.type,
            quality=b.quality,
            max_concurrent=remote.capacity,
            modes=list(remote.modes),
            apis=["openai", "anthropic", "responses"],  # a corrallm speaks every dialect
            peer=view.name,
        )
        same = [i for i, x in enumerate(backends) if (x.type, x.quality) == (b.type, b.quality)]
        if same:
            backends.insert(same[0] if first else same[-1] + 1, backend)
        else:
            backends.append(backend)
    if local is not None:
        return local.model_copy(update={"backends": backends})
    aliases = [{"name": a} for a in found[0][1].aliases if a not in config.models]
    return ModelConfig.model_validate({"backends": backends, "aliases": aliases, "unlisted": False})
