"""One organisation's part of a service-mode federation, for its own Kubernetes cluster.

`tfe_estimator.cluster.manifests` renders a whole cluster into one namespace; across
organisations each site runs only its own party, in its own cluster, and reaches the others
over the internet. `render_party` renders exactly that part, from the public federation file
(`tfe_estimator.identity.federation`):

- a data owner (``chief:0``, ``worker:k``): its Job on the training image, its certificate Secret
  referenced (made by ``tfe-estimator certs secret``; no key is ever in a rendered manifest), its data
  claim (read-only, ``TFE_ESTIMATOR_DATA_DIR``) and its model claim (required: its checkpoints,
  ``TFE_ESTIMATOR_MODEL_DIR``; rendered with a size), and a NetworkPolicy with no ingress rule at
  all and egress only to the two servers' IP ranges on their two ports each (and DNS when a
  server's address is a host name);
- a server operator (``tfe:0``, ``tfe:1``): its Deployment on its own server image, probed with
  ``tfe-estimator health``, with a metrics port and, for server0, its state directory
  (`tfe_estimator.cluster.k8s_server`), a Service other organisations can reach (``LoadBalancer``,
  ``NodePort`` or ``ClusterIP`` behind an address the operator routes) and a NetworkPolicy admitting
  only its two mTLS ports (from the given CIDRs) and its metrics port from the site's monitoring
  only; server0 may connect out to server1 only, server1 to nobody.

Every object is in the party's namespace; `prerequisites` lists what the site creates before it
applies them (`tfe_estimator.cluster.k8s_party.prerequisites`: the namespace, the Secret, an owner's
claims). An option of the other role (a claim on a server, a server image or metrics on an owner) is
refused (`k8s_party.check_roles`).

A server's two ports are its federation address's port (gRPC) and the next one, its data port
(`manifests.data_port`, ``tfe-estimator server --data-port``: the step's large calls without gRPC's
copies), the convention every site renders with, so an owner's egress admits each server's data port
without being told it. The server announces the port it binds (the ``DataPlane`` call) and callers
dial it at the server's federation host, so the data port is the same number at every hop: container
port, Service port and, with ``NodePort``, node port (hence also in 30000-32767), as the gRPC port is.
``data_plane=False`` (``--no-data-plane``) is a server operator's choice: its server runs gRPC only
and the owners, asking, find no data port; an owner cannot opt out (its client uses every data port a
server announces, so its egress must reach them).

Every site's TF_CONFIG lists the same cluster, derived from the federation file alone (owners
by identity, at names nothing resolves; the servers at their federation addresses), so the
owners' common initial weights (`tfe_estimator.cluster.spec.cluster_digest`) agree across sites.
Nothing here imports TensorFlow.

Example::

    from tfe_estimator.cluster import k8s_site
    from tfe_estimator.identity.federation import Federation

    fed = Federation.load("federation.json")
    objs = k8s_site.render_party(fed, "worker:0", "demo", "example.com/train:1",
                                 server_cidrs={"tfe:0": "203.0.113.10/32", "tfe:1": "198.51.100.7/32"})

or from a shell::

    tfe-estimator k8s --name demo --image example.com/train:1 --federation federation.json \\
        --party worker:0 --server-cidr tfe:0=203.0.113.10/32 --server-cidr tfe:1=198.51.100.7/32 \\
        -- python train.py
"""
import ipaddress
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from tfe_estimator.cluster import k8s_server, peers
from tfe_estimator.cluster.k8s_party import check_roles, model_claim_manifest
from tfe_estimator.cluster.k8s_common import (DEFAULT_COMMAND, DEFAULT_RESOURCES, DEFAULT_RUN_AS_USER,
                                              DEFAULT_TLS_SECRET, SERVICE_TFE_TASKS, check_active_deadline_seconds,
                                              check_arguments, check_image, check_tls_secret, labels,
                                              pod_security_context, selector)
from tfe_estimator.cluster.manifests import _pod_spec, data_port  # pylint: disable=protected-access
from tfe_estimator.cluster.model_dir_claim import MODEL_DIR_ENV
from tfe_estimator.cluster.spec import (DATA_DIR_ENV, TFE_JOB, cluster_digest, cluster_jobs, cluster_tasks,
                                        tf_config_json)
from tfe_estimator.identity import certs
from tfe_estimator.identity.federation import SERVERS, Federation

__all__ = ["render_party", "owner_address", "EXPOSE_TYPES", "NODE_PORTS", "DIGEST_ANNOTATION"]

#: On every rendered workload: the cluster's digest, the same at every site (compare it before starting).
DIGEST_ANNOTATION = "tfe-estimator/cluster-digest"

#: How a server's Service is exposed to the other organisations (`render_party`'s `expose`).
EXPOSE_TYPES = ("LoadBalancer", "NodePort", "ClusterIP")
#: The ports a NodePort may use (Kubernetes' default service-node-port-range).
NODE_PORTS = range(30000, 32768)
_DNS = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}


def owner_address(job: str, index: int, cluster: str) -> str:
    """An owner's TF_CONFIG address: a name only (owners listen nowhere), the same at every site."""
    return f"{certs.task_name(job, index)}.{cluster}.invalid:1"


def _split(identity: str, source: str) -> Tuple[str, int]:
    job, sep, index = str(identity).partition(":")
    if not sep or not index.isdigit():
        raise ValueError(f"{source} {identity!r} is not an identity 'job:index' such as 'worker:0' or 'tfe:1'.")
    return job, int(index)


def _owner_tasks(fed: Federation) -> List[Tuple[str, int]]:
    """chief:0 and worker:0..n-1 from the federation's parties; anything else is refused, naming it."""
    owners = sorted((_split(i, "federation party") for i in fed.parties if i not in SERVERS),
                    key=lambda t: (t[0] != "chief", t))
    workers = sum(1 for job, _ in owners if job == "worker")
    expected = cluster_tasks(workers, False, 0)
    if owners != expected:
        raise ValueError(f"{fed.source} names the data owners {[f'{j}:{i}' for j, i in owners]}; a service-mode "
                         f"cluster needs exactly {[f'{j}:{i}' for j, i in expected]} (chief:0 and worker:0.."
                         f"worker:{workers - 1}). Fix the --party list of `tfe-estimator certs federation`.")
    return owners


def _server_addresses(fed: Federation, overrides: Mapping[str, str]) -> Dict[str, Tuple[str, int]]:
    """``tfe:k`` -> (host, port), from the federation file or `overrides` (``--server-address``)."""
    result = {}
    for bad in set(overrides) - set(SERVERS):
        raise ValueError(f"--server-address {bad}=...: only the servers {list(SERVERS)} have addresses.")
    for k, identity in enumerate(SERVERS):
        address = overrides.get(identity) or fed.server_address(k)
        if not address:
            raise ValueError(f"{fed.source} gives aggregation server {identity} no address: give one with "
                             f"`tfe-estimator certs federation --server {identity}=HOST:PORT` (every site must use "
                             f"the same) or --server-address {identity}=HOST:PORT.")
        host, sep, port = address.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"the address of {identity}, {address!r}, must be HOST:PORT with a port in 1..65535, "
                             "e.g. 'tfe0.operator-x.example:7000'.")
        result[identity] = (host, int(port))
    return result


def _cidr(value: str, source: str) -> str:
    try:
        return str(ipaddress.ip_network(value, strict=False))
    except ValueError:
        raise ValueError(f"{source} {value!r} is not an IP range such as '203.0.113.10/32' or "
                         "'2001:db8::/64'.") from None


def _host_cidr(host: str) -> Optional[str]:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    return str(ipaddress.ip_network(f"{ip}/{ip.max_prefixlen}"))


def _server_cidrs(addresses: Mapping[str, Tuple[str, int]], given: Mapping[str, str],
                  needed: Sequence[str]) -> Dict[str, str]:
    """The IP range of each server in `needed`: given (``--server-cidr``), or its address if that is an IP."""
    for bad in set(given) - set(SERVERS):
        raise ValueError(f"--server-cidr {bad}=...: only the servers {list(SERVERS)} are reached by address.")
    result = {}
    for identity in needed:
        host = addresses[identity][0]
        cidr = _cidr(given[identity], f"--server-cidr {identity}=") if identity in given else _host_cidr(host)
        if cidr is None:
            raise ValueError(f"the address of {identity} is the host name {host!r}, and a NetworkPolicy allows "
                             f"egress by IP range only: give its range with --server-cidr {identity}=CIDR "
                             "(e.g. the operator's load balancer, 203.0.113.10/32).")
        result[identity] = cidr
    return result


def _ports(port: int) -> List[Dict[str, Any]]:
    """A server's ports as a NetworkPolicy names them: its service port and its data port (when there is room)."""
    return [{"protocol": "TCP", "port": p} for p in (port, data_port(port)) if p <= 65535]


def _policy(name: str, namespace: str, task: Tuple[str, int], ingress: List[Dict[str, Any]],
            egress: List[Dict[str, Any]]) -> Dict[str, Any]:
    job, index = task
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{name}-{job}-{index}-peers", "namespace": namespace,
                         "labels": labels(name, job, index)},
            "spec": {"podSelector": {"matchLabels": selector(name, job, index)},
                     "policyTypes": ["Ingress", "Egress"], "ingress": ingress, "egress": egress}}


def render_party(
    fed: Federation,
    party: str,
    name: str,
    image: str,
    command: Sequence[str] = DEFAULT_COMMAND,
    namespace: str = "default",
    server_addresses: Optional[Mapping[str, str]] = None,
    server_cidrs: Optional[Mapping[str, str]] = None,
    allow_from: Sequence[str] = (),
    expose: str = "LoadBalancer",
    tls_secret: str = DEFAULT_TLS_SECRET,
    data_claim: Optional[str] = None,
    data_mount_path: str = "/data",
    model_claim: Optional[str] = None,
    model_mount_path: str = "/model",
    active_deadline_seconds: Optional[int] = None,
    resources: Optional[Dict[str, Dict[str, str]]] = None,
    run_as_user: int = DEFAULT_RUN_AS_USER,
    read_only_root: bool = False,
    data_plane: bool = True,
    server_image: Optional[str] = None,
    metrics_port: Optional[int] = k8s_server.DEFAULT_METRICS_PORT,
    metrics_namespace: Optional[str] = None,
    metrics_pod_labels: Optional[Mapping[str, str]] = None,
    model_claim_size: Optional[str] = None,
    storage_class: Optional[str] = None,
) -> List[Dict[str, Any]]:
    """The manifests of one party of federation `fed`, for its own organisation's cluster.

    Args:
      fed: the federation (``Federation.load("federation.json")``): its owners, servers and addresses.
      party: this organisation's party, ``"chief:0"``, ``"worker:k"``, ``"tfe:0"`` or ``"tfe:1"``.
      name: prefix of every object and the ``tfe-estimator/cluster`` label (as ``certs secret --name``).
      image, command, namespace, data_claim, data_mount_path, model_claim, model_mount_path,
      active_deadline_seconds, resources, run_as_user, read_only_root: as `manifests.render_manifests`.
      server_addresses: ``tfe:k`` -> ``HOST:PORT`` instead of the federation file's (every site must use the
        same: the owners' initial weights derive from the cluster).
      server_cidrs: ``tfe:k`` -> IP range: where an owner (and server0, for server1) may connect; needed for a
        server whose address is a host name.
      allow_from: a server's admitted IP ranges (the owners' egress addresses, and server0's for server1);
        empty: any source, on its two ports (the service port and the data port).
      expose: a server's Service type, one of `EXPOSE_TYPES` (``NodePort``: the address's port and its data
        port, the next one, must be node ports, 30000-32767).
      data_plane: a server's data port, its address's port + 1 (the default); False: the server runs gRPC
        only (no ``--data-port``, no second port on its Service or in its NetworkPolicy). An owner's egress
        always admits the servers' data ports (refused for an owner: whether a server has one is its
        operator's choice).
      tls_secret: the party's Secret name (``{name}``, ``{job}``, ``{index}``), from ``tfe-estimator certs secret``.
      data_claim, model_claim: an owner's claims (refused for a server, which never sees data or the model).
        An owner needs `model_claim`: its checkpoints (``TFE_ESTIMATOR_MODEL_DIR``, ``<mount>/<job>-<index>``)
        must outlive its container, and its egress reaches the two servers only. Its data is on `data_claim`
        (``TFE_ESTIMATOR_DATA_DIR``, the mount path) or in its image.
      model_claim_size, storage_class: an owner's model claim rendered as a PersistentVolumeClaim of that size
        (``ReadWriteOnce``; the cluster's default storage class unless `storage_class`); None: the site makes
        it (`k8s_party.prerequisites` says so).
      server_image: a server's image (``tfe-estimator server`` needs ``tfe_estimator``, not the owners' training
        script; default `image`); refused for an owner.
      metrics_port, metrics_namespace, metrics_pod_labels: a server's metrics (`k8s_server`): ``--metrics-port``
        and a ``metrics`` container port (None: none), on no Service; its NetworkPolicy admits the site's
        monitoring (that namespace, those pod labels) to it, nobody without them. Refused for an owner.

    A server also gets probes calling its own health service (``tfe-estimator health``) and server0 its state
    directory, ``TFE_ESTIMATOR_STATE_DIR``, on an emptyDir (`k8s_server`).

    Returns:
      JSON-compatible manifests: an owner's Job and NetworkPolicy (and its model claim with `model_claim_size`);
      a server's Service, Deployment and NetworkPolicy, every one in `namespace`. No Secret: each organisation
      creates its own party's from its own directory.

    Raises:
      ValueError: naming the bad value and the fix.
    """
    job, index = _split(party, "--party")
    if party not in fed.parties:
        raise ValueError(f"--party {party}: {fed.source} has no such party (its parties: {sorted(fed.parties)}).")
    owners = _owner_tasks(fed)
    tasks = owners + [(TFE_JOB, k) for k in range(SERVICE_TFE_TASKS)]
    addresses = _server_addresses(fed, dict(server_addresses or {}))
    if expose not in EXPOSE_TYPES:
        raise ValueError(f"--expose {expose!r}: use one of {', '.join(EXPOSE_TYPES)}.")
    sources = [_cidr(c, "--allow-from") for c in allow_from]
    if sources and job != TFE_JOB:
        raise ValueError(f"--allow-from is for a server's party; {party} is a data owner and admits no "
                         "connection at all. Drop --allow-from.")
    if not isinstance(data_plane, bool):
        raise TypeError(f"data_plane={data_plane!r} must be True (the server's data port) or False (gRPC only).")
    if not data_plane and job != TFE_JOB:
        raise ValueError(f"--no-data-plane is for a server's party; {party} is a data owner, whose client uses "
                         "the data port each server announces, so its egress must admit them (whether a server "
                         "has one is its operator's choice: `--party tfe:K --no-data-plane`). Drop --no-data-plane.")
    check_arguments(name, image, len(owners) - 1, command, namespace, addresses[SERVERS[0]][1],
                    {"data": (data_claim, data_mount_path), "model": (model_claim, model_mount_path)})
    check_roles(party, job == TFE_JOB, data_claim, model_claim, model_claim_size, storage_class, server_image,
                 metrics_namespace, metrics_pod_labels)
    check_active_deadline_seconds(active_deadline_seconds)
    check_tls_secret(name, [(job, index)], tls_secret)
    pod_security_context(run_as_user)
    resources = DEFAULT_RESOURCES if resources is None else resources

    def address(j: str, i: int) -> str:
        if j == TFE_JOB:
            host, port = addresses[SERVERS[i]]
            return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return owner_address(j, i, fed.cluster)

    jobs = cluster_jobs(tasks, address)
    tf_config = tf_config_json(jobs, job, index)
    task_labels = labels(name, job, index)
    metadata = {"name": f"{name}-{job}-{index}", "namespace": namespace, "labels": dict(task_labels),
                "annotations": {DIGEST_ANNOTATION: cluster_digest(jobs).hex()[:16]}}
    pod_options = {"resources": resources, "run_as_user": run_as_user, "read_only_root": read_only_root,
                   "mode": peers.SERVICE, "cert_secret": tls_secret.format(name=name, job=job, index=index)}
    if job != TFE_JOB:
        objs = _owner(fed, (job, index), metadata, name, namespace, image, command, tf_config, addresses,
                      dict(server_cidrs or {}), pod_options, data_claim, data_mount_path, model_claim,
                      model_mount_path, active_deadline_seconds)
        if model_claim_size is not None:
            objs.insert(0, model_claim_manifest(model_claim.format(name=name, job=job, index=index), namespace,
                                  labels(name, job, index), model_claim_size, storage_class))
        return objs
    if server_image is not None:
        check_image(server_image, "--server-image")
    host, port = addresses[party]
    if host == "localhost" or (_host_cidr(host) or "").startswith(("127.", "::1/")):
        raise ValueError(f"{party}'s address {host}:{port} is a loopback address: the server would bind it and "
                         "nobody outside its pod could connect. Give its public HOST:PORT in the federation file "
                         f"(`certs federation --server {party}=HOST:PORT`) or --server-address {party}=HOST:PORT.")
    if expose == "NodePort" and port not in NODE_PORTS:
        raise ValueError(f"--expose NodePort: {party}'s address port {port} is no node port (30000-32767): give "
                         "the server an address with a node port (its federation address or --server-address) "
                         "or use --expose LoadBalancer.")
    data = data_port(port) if data_plane else None
    if data is not None:
        _check_data_port(party, addresses, expose)
    k8s_server.check_metrics_port(metrics_port, {port: f"service port ({party}'s address port)", **(
        {data: f"data port (its address port + 1, {data})"} if data is not None else {})})
    metrics = k8s_server.metrics_ingress(metrics_port, k8s_server.metrics_sources(metrics_namespace,
                                                                                 dict(metrics_pod_labels or {})))
    command = k8s_server.server_command(data, metrics_port)
    pod_spec = _pod_spec(job, server_image or image, command, tf_config, port, "Always", listens=True,
                         **pod_options)
    # The data port is the same number in the container, on the Service and (NodePort) on every node: the server
    # announces the port it binds, and callers dial it at the federation host.
    service_ports: List[Dict[str, Any]] = [{"name": "grpc", "port": port, "targetPort": port, "protocol": "TCP"}]
    if data is not None:
        pod_spec["containers"][0]["ports"].append({"name": "data", "containerPort": data, "protocol": "TCP"})
        service_ports.append({"name": "data", "port": data, "targetPort": data, "protocol": "TCP"})
    k8s_server.add_server_parts(pod_spec, index, metrics_port)  # probes, metrics (on no Service), server0's state
    service_spec: Dict[str, Any] = {"type": expose, "selector": selector(name, job, index), "ports": service_ports}
    if expose == "NodePort":
        for service_port in service_ports:
            service_port["nodePort"] = service_port["port"]
    if expose != "ClusterIP":
        # Keep the callers' source addresses, so the NetworkPolicy's ranges see them.
        service_spec["externalTrafficPolicy"] = "Local"
    if expose == "LoadBalancer" and sources:
        service_spec["loadBalancerSourceRanges"] = list(sources)
    manifests = [{"apiVersion": "v1", "kind": "Service", "metadata": dict(metadata), "spec": service_spec}]
    manifests.append({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": dict(metadata),
        "spec": {"replicas": 1, "strategy": {"type": "Recreate"},
                 "selector": {"matchLabels": selector(name, job, index)},
                 "template": {"metadata": {"labels": dict(task_labels)}, "spec": pod_spec}}})
    rule: Dict[str, Any] = {"ports": _ports(port) if data is not None else [{"protocol": "TCP", "port": port}]}
    if sources:
        rule["from"] = [{"ipBlock": {"cidr": c}} for c in sources]
    egress: List[Dict[str, Any]] = []
    if index == 0:  # server0 sends its blinded part to server1 (on server1's data port if it has one), nothing else
        cidr = _server_cidrs(addresses, dict(server_cidrs or {}), [SERVERS[1]])[SERVERS[1]]
        egress.append({"to": [{"ipBlock": {"cidr": cidr}}], "ports": _ports(addresses[SERVERS[1]][1])})
        if _host_cidr(addresses[SERVERS[1]][0]) is None:
            egress.append(_DNS)
    manifests.append(_policy(name, namespace, (job, index), [rule, *metrics], egress))
    return manifests


def _check_data_port(party: str, addresses: Mapping[str, Tuple[str, int]], expose: str) -> None:
    """Refuses a server's data port (its port + 1) that cannot be opened, naming the fix."""
    host, port = addresses[party]
    data = data_port(port)
    if data > 65535:
        raise ValueError(f"{party}'s address port {port} leaves no room for its data port (the next one, {data}): "
                         "give the server another port in the federation file (or --server-address), or render "
                         "it with --no-data-plane (every call on gRPC).")
    if expose == "NodePort" and data not in NODE_PORTS:
        raise ValueError(f"--expose NodePort: {party}'s data port {data} (its address port {port} + 1) is no node "
                         "port (30000-32767): give the server an address port below 32767, or render it with "
                         "--no-data-plane (every call on gRPC).")
    for other in SERVERS:
        if other != party and addresses[other] == (host, data):
            raise ValueError(f"{party}'s data port {host}:{data} (its address port + 1) is {other}'s service "
                             f"address: give the two servers ports at least 2 apart (e.g. {other} at "
                             f"{host}:{data + 1}), or render {party} with --no-data-plane.")


def _owner(fed, task, metadata, name, namespace, image, command, tf_config, addresses, server_cidrs, pod_options,
           data_claim, data_mount_path, model_claim, model_mount_path, active_deadline_seconds):
    """A data owner's Job and its NetworkPolicy (no ingress; egress to the two servers' two ports only)."""
    job, index = task
    mounts = []
    if data_claim is not None:
        mounts.append(("data", data_claim.format(name=name, job=job, index=index), data_mount_path, True))
    if model_claim is not None:
        mounts.append(("model", model_claim.format(name=name, job=job, index=index), model_mount_path, False))
    pod_spec = _pod_spec(job, image, command, tf_config, 1, "OnFailure", mounts, listens=False, **pod_options)
    env = pod_spec["containers"][0]["env"]
    if data_claim is not None:
        env.append({"name": DATA_DIR_ENV, "value": data_mount_path})
    if model_claim is not None:
        env.append({"name": MODEL_DIR_ENV, "value": f"{model_mount_path.rstrip('/')}/{job}-{index}"})
    job_spec: Dict[str, Any] = {"backoffLimit": 4,
                                "template": {"metadata": {"labels": dict(metadata["labels"])}, "spec": pod_spec}}
    if active_deadline_seconds is not None:
        job_spec["activeDeadlineSeconds"] = active_deadline_seconds
    cidrs = _server_cidrs(addresses, server_cidrs, SERVERS)
    # Each server's service port and its data port: the owner's client uses the data port a server announces.
    egress = [{"to": [{"ipBlock": {"cidr": cidrs[s]}}], "ports": _ports(addresses[s][1])} for s in SERVERS]
    if any(_host_cidr(addresses[s][0]) is None for s in SERVERS):
        egress.append(_DNS)  # the servers' names resolve through the cluster's DNS
    return [{"apiVersion": "batch/v1", "kind": "Job", "metadata": dict(metadata), "spec": job_spec},
            _policy(name, namespace, task, [], egress)]
