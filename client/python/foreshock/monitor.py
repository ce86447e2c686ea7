"""Monitor: the training-side entry point of the Foreshock client.

    monitor = Monitor("127.0.0.1:50051", run_id="run-42", job="pretrain",
                      model=model, probe_batch=probe_tokens, every=50)
    for step in ...:
        ...; optimizer.step()
        monitor.step(step, loss=loss.item(), grad_norm=gn, lr=lr)
    monitor.close()

What runs on the training thread: building records and a non-blocking
enqueue every step, plus, every `every` steps, one no-grad forward of the
fixed probe batch. Everything that touches the network runs on the sender
thread (sender.py).
"""
import logging
from collections.abc import Mapping
import sys
import time

import torch

from foreshock import capture, distributed, encoding, output_check, sampling, sharding
from foreshock.alerts import AlertWatcher
from foreshock.security import Security
from foreshock.sender import RecordQueue, Sender
from foreshock.v1 import ingest_pb2 as pb

log = logging.getLogger("foreshock")



# The daemon's bounds on Hello.labels (docs/DESIGN.md §3.1): beyond them it
# refuses the Hello (bad_labels) and the Monitor would never connect, so they
# are checked here, where the caller can still fix them.
MAX_LABELS, MAX_LABEL_KEY_BYTES, MAX_LABEL_VALUE_BYTES, MAX_LABELS_BYTES = 64, 128, 1024, 16 << 10


def _check_labels(labels):
    if len(labels) > MAX_LABELS:
        raise ValueError(f"{len(labels)} labels; the daemon accepts at most {MAX_LABELS}")
    total = 0
    for key, value in labels.items():
        k, v = len(str(key).encode()), len(str(value).encode())
        if k > MAX_LABEL_KEY_BYTES or v > MAX_LABEL_VALUE_BYTES:
            raise ValueError(f"label {str(key)[:40]!r}: key of {k} bytes, value of {v}; the "
                             f"daemon accepts keys of at most {MAX_LABEL_KEY_BYTES} bytes and "
                             f"values of at most {MAX_LABEL_VALUE_BYTES}")
        total += k + v
    if total > MAX_LABELS_BYTES:
        raise ValueError(f"labels of {total} bytes in all; the daemon accepts at most "
                         f"{MAX_LABELS_BYTES}")


class Monitor:
    """Samples a model's internals on a fixed probe batch and streams them to foreshockd.

    Args:
      endpoint: foreshockd's gRPC address, "host:port"; or several daemons to
        shard runs over: "a:1,b:2,c:3", a list of them (or `endpoints=`), or
        "dns:///name:port" for every address a name resolves to (a Kubernetes
        headless Service). The run's daemon is picked by rendezvous hashing of
        run_id (foreshock.sharding), so every rank of a run, and on_alert, use
        the same daemon; `monitor.endpoint` says which.
      endpoints: the daemon list as a keyword (instead of endpoint).
      run_id, job, rank, labels: identify the stream (sent in Hello). rank
        defaults to torch.distributed's rank when it is initialized (else 0);
        with several ranks, labels get world_size (foreshock.distributed).
      probe_all_ranks: by default only rank 0 probes Q/K, routers and curvature
        (data-parallel ranks hold the same weights, and the daemon pairs
        consecutive samples of a (run, layer, probe_id): several ranks probing
        the same batch would interleave). Every rank still sends its scalars.
        Set it when ranks hold different shards (tensor/pipeline parallel)
        and give each rank its own probe_id.
      model: the torch module to probe (None: scalars only). A DDP, FSDP2
        (fully_shard) or torch.compile'd model works as given; FSDP1 and
        DeepSpeed engines are refused (foreshock.distributed).
      probe_batch: the fixed model input of every probe: a tensor (model(x)),
        a tuple/list (model(*x)) or a dict (model(**x)). Keep it fixed for the
        whole run: increments compare consecutive samples of the same batch.
      every: probe interval in steps (a probe runs when step % every == 0).
      model_info: a ModelInfo for Hello; by default derived from discovery.
        Its n_heads/top_k also serve discovery for modules lacking them.
      dtype: wire dtype of Q/K, "bf16" (default), "fp16" or "fp32".
      queue_size: bound of the record queue, in records (queue_bytes bounds bytes).
      tap: optional callable receiving every Record before it is queued.
      probe_id: names the probe batch; increments pair samples of one probe_id.
      causal: whether the sampled attention is causal.
      probe_heads: send this many query heads per layer and probe, a
        rotating subset (every head is seen every ceil(heads / probe_heads)
        probes), with only the K heads they use (foreshock.sampling). None: all.
      probe_tokens: send at most this many tokens of each layer's Q/K: whole
        sequences of the probe batch, or a prefix of the first (exact for
        causal attention). None: all.
      max_probe_bytes: a probe whose Q/K would exceed this (48 MiB: under
        max_unacked_bytes, so a probe survives a reconnect) is sampled: first
        256 tokens, then fewer query heads per probe, each unless set above
        (foreshock.sampling.plan; logged once). A 70B-class model (80 layers,
        64 heads, 8 KV heads, head_dim 128) then sends 8 heads x 256 tokens
        per layer. None: no limit.
      broadcast_kv: send grouped-query K repeated for every query head, as
        clients did before K went on the wire with its own heads. Only for a
        foreshockd older than that (it rejects K with fewer heads than Q as
        shape_mismatch); it multiplies K's bytes by heads / kv_heads.
      attention_dtype: the dtype the model computes attention in, "fp32",
        "bf16" or "fp16", sent with every QK sample (QKSample.attention_dtype).
        None (default): what the probe forward computed attention in: the
        output dtype of a transformers attention function (under autocast a
        bf16 kernel is often handed fp32 Q/K: rotary with fp32 cos/sin
        promotes them), else the autocast dtype when the probe ran under
        autocast, else the captured Q's dtype. Set it when a kernel computes
        attention in another precision than that. fp32 attention rules out a
        precision fault in the daemon's probable cause.
      autocast: the mixed precision the probe forward runs under, so that it
        computes as the training forward does. None (default): follow the
        training forward: the monitor notes torch's autocast state (enabled,
        dtype) each time the model's first attention module (or the model)
        runs outside a probe, and the probe runs under the same autocast,
        even when step() is called outside the autocast block, as it should
        be (after optimizer.step()). "bf16"/"fp16" or a torch dtype: always
        autocast to it; False: never. The Trainer and Lightning callbacks set
        it from bf16=/fp16= and precision="bf16-mixed"/"16-mixed".
      output_check: on the probe, compare each discovered bf16/fp16 attention's
        output with the same attention function run on fp32 inputs, and send
        the rounding error's means (QKSample.output_check; the daemon's
        attention_output_bias). Costs one fp32 attention per layer per probe.
        Models that call capture_qk can check with check_attention_output().
      discover: attach discovery hooks for Q/K (ignored once capture_qk is used).
      discover_routers: attach discovery hooks for MoE routers (on by default).
      router_dtype: wire dtype of router logits (fp32 by default: they are
        small, and bf16 ties would blur top-k flips).
      curvature: an optional foreshock.curvature.CurvatureEstimator; step()
        runs it when it is due (its own `every`, stretched to keep its time
        within its `budget` of the training time step() measures between its
        calls) and sends a CurvatureSample.
      token: bearer token for a daemon with --token_file (default
        $FORESHOCK_TOKEN); sent as `authorization: Bearer <token>`.
      tls_ca, tls_cert, tls_key: PEM files for a daemon with --tls_cert: the CA
        that signed it, and the client certificate/key when it requires one.
    """

    def __init__(self, endpoint=None, run_id=None, job=None, model=None, probe_batch=None,
                 every=100, rank=None,
                 labels=None, model_info=None, dtype="bf16", queue_size=1024, tap=None, *,
                 probe_id="default", causal=True, discover=True, discover_routers=True,
                 router_dtype="fp32", queue_bytes=256 << 20, max_unacked_bytes=64 << 20,
                 max_batch_bytes=1 << 20,
                 backoff_initial_s=0.1, backoff_max_s=5.0, channel_options=(), curvature=None,
                 probe_all_ranks=False, endpoints=None, token=None, tls_ca=None, tls_cert=None,
                 tls_key=None, broadcast_kv=False, probe_heads=None, probe_tokens=None,
                 max_probe_bytes=48 << 20, attention_dtype=None, output_check=True,
                 autocast=None):
        if run_id is None or job is None:
            raise TypeError("Monitor() needs run_id and job")
        if (endpoint is None) == (endpoints is None):
            raise TypeError("Monitor() needs one of endpoint and endpoints")
        if every < 1:
            raise ValueError("every must be >= 1")
        # DDP, torch.compile: discover on and probe through the wrapped module;
        # FSDP2: the probe forward is collective (foreshock.distributed).
        self._layout = distributed.layout_of(model, discover or discover_routers)
        model = self._layout.module
        rank = distributed.default_rank(rank)
        labels = distributed.hello_labels(labels)
        _check_labels(labels)
        self.rank = rank
        self.model = model
        self.probe_batch = probe_batch
        self.every = every
        self.dtype = encoding.check_dtype(dtype)
        self.router_dtype = encoding.check_dtype(router_dtype)
        self.attention_dtype = None if attention_dtype is None \
            else encoding.check_dtype(attention_dtype)
        self.autocast = _check_autocast(autocast)
        self._training_autocast = None  # (device type, dtype) of the last training forward
        self.probe_id = probe_id
        self.causal = causal
        self.output_check = bool(output_check)
        self._output_check_warned = False
        self.broadcast_kv = broadcast_kv
        self.probe_heads = sampling.check(probe_heads, "probe_heads")
        self.probe_tokens = sampling.check(probe_tokens, "probe_tokens")
        self.max_probe_bytes = sampling.check(max_probe_bytes, "max_probe_bytes")
        self._sampling_logged = None
        self._plan_cache = None
        self.tap = tap
        self.curvature = curvature
        self._description = None  # what the first probe found (describe())
        self.probes_here = probe_all_ranks or rank == 0
        # Resolved once: a run keeps its daemon for the life of the process.
        self.endpoints = sharding.resolve(endpoint if endpoints is None else endpoints)
        self.endpoint = sharding.pick(run_id, self.endpoints)
        if len(self.endpoints) > 1:
            log.info("foreshock: run %s goes to %s (one of %d daemons)", run_id, self.endpoint,
                     len(self.endpoints))
        self._run_id = run_id
        self._channel_options = channel_options
        # TLS files and the bearer token (default $FORESHOCK_TOKEN) for every
        # connection to the daemon (foreshock.security).
        self._security = Security(token=token, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key)
        self._alerts = None  # an AlertWatcher once on_alert is used

        given = model_info or capture.ModelInfo()
        self.attention_sites = []
        self.router_sites = []
        if model is not None and discover:
            self.attention_sites = capture.discover_attention(model, given.n_heads)
        if model is not None and discover_routers:
            self.router_sites = capture.discover_routers(model, self.attention_sites, given.top_k)
        self.model_info = model_info or capture.model_info_from_sites(self.attention_sites,
                                                                      self.router_sites)
        if model is not None and (discover or discover_routers):
            # One line that says what will be probed, so that a model whose
            # layers were not found is noticed at start, not on a dashboard.
            log.info("foreshock: discovery found %d attention layer(s)%s and %d router(s)%s",
                     len(self.attention_sites), _site_list(self.attention_sites),
                     len(self.router_sites), _site_list(self.router_sites))
        # The training forward's autocast, noted where attention runs (a
        # pre-hook: accelerate wraps model.forward itself in autocast, so the
        # root module's own pre-hooks run outside it).
        self._autocast_hook = None
        if model is not None:
            watched = self.attention_sites[0].module if self.attention_sites and \
                self.attention_sites[0].module is not None else model
            self._device_type = _device_type(model)
            self._autocast_hook = watched.register_forward_pre_hook(self._note_autocast)
        # Set by the first probe in which capture_qk/capture_router is called:
        # from then on the discovery hooks of that kind are not attached.
        self._explicit_qk = False
        self._explicit_router = False
        self._collector = None  # a ProbeCollector while a probe forward runs

        self._counts = dict(enqueued=0, dropped_queue_full=0, dropped_after_close=0, probes=0,
                            probes_joined=0, curvature_estimates=0, curvature_failures=0,
                            probe_failures=0)
        self._probe_seconds = 0.0
        self._curvature_seconds = 0.0
        # Training time: the time between step() calls, outside step() itself
        # (the probe and curvature run inside it); the curvature budget's base.
        self._train_seconds = 0.0
        self._step_clock = None
        self._queue = RecordQueue(queue_size, queue_bytes)
        hello = pb.Hello(run_id=run_id, job=job, rank=rank,
                         model=self.model_info.to_proto(), labels=labels)
        # Sent batches are kept (up to max_unacked_bytes) until acked, and
        # resent after a reconnect (foreshock.sender).
        self._sender = Sender(self.endpoint, hello, self._queue, max_unacked_bytes=max_unacked_bytes,
                              max_batch_bytes=max_batch_bytes,
                              backoff_initial_s=backoff_initial_s, backoff_max_s=backoff_max_s,
                              channel_options=channel_options, security=self._security)
        self._closed = False
        self._sender.start()

    # -- training-thread API --------------------------------------------------

    def step(self, step, loss=None, grad_norm=None, lr=None):
        """Records the step's scalars; every `every` steps, also probes the model.

        Call it after optimizer.step(), so the probe sees the updated weights.
        Scalars may be floats or 0-d tensors (a tensor costs a device sync).
        """
        now = time.perf_counter()
        if self._step_clock is not None:
            self._train_seconds += now - self._step_clock
        try:
            self._step(step, loss, grad_norm, lr)
        finally:
            self._step_clock = time.perf_counter()

    def _step(self, step, loss, grad_norm, lr):
        record = pb.Record(step=step)
        record.scalars.SetInParent()  # an all-absent StepScalars still marks the step
        if loss is not None:
            record.scalars.loss = float(loss)
        if grad_norm is not None:
            record.scalars.grad_norm = float(grad_norm)
        if lr is not None:
            record.scalars.lr = float(lr)
        self._emit(record)
        probe_due = self.model is not None and self.probe_batch is not None and \
            step % self.every == 0
        if not self.probes_here:
            if probe_due and self._layout.collective:
                self.join_probe()  # FSDP2: every rank runs the forward; this one sends nothing
            return
        if probe_due:
            try:
                self.probe(step)
            except Exception:  # the training step is sacred: log, count, go on
                self._counts["probe_failures"] += 1
                n = self._counts["probe_failures"]
                if n == 1 or n % 100 == 0:
                    log.exception("foreshock: probe at step %d failed (%d so far); training "
                                  "continues without this probe", step, n)
        if self.curvature is not None and self.curvature.due(step, self._train_seconds):
            self.estimate_curvature(step)

    def estimate_curvature(self, step):
        """Runs the curvature estimator now and queues its CurvatureSample.
        A failing estimate (e.g. a blown-up model whose Lanczos matrix is not
        finite) is counted in stats()["curvature_failures"] and skipped: it
        never reaches the training loop."""
        try:
            estimate = self.curvature.estimate()
        except Exception as e:  # noqa: BLE001 - training is sacred
            self._counts["curvature_failures"] += 1
            # The traceback once; a blown-up model fails every later estimate too.
            first = self._counts["curvature_failures"] == 1
            log.warning("foreshock: curvature estimate at step %d failed (%s); skipped", step,
                        e if not first else type(e).__name__, exc_info=first)
            self.curvature.reset()  # the warm start may be the culprit
            return None
        record = pb.Record(step=step)
        record.curvature.CopyFrom(estimate.to_proto(pb))
        self._emit(record)
        self._counts["curvature_estimates"] += 1
        self._curvature_seconds += estimate.seconds
        return estimate

    def probe(self, step):
        """Runs the probe forward now and queues its QK (and router) samples."""
        if self.model is None or self.probe_batch is None:
            raise ValueError("probe() needs the monitor's model and probe_batch")
        start = time.perf_counter()
        collector = capture.ProbeCollector(reduce=self._capture_reducer(),
                                           check_outputs=self.output_check)
        handles = collector.attach(
            [] if self._explicit_qk else self.attention_sites,
            [] if self._explicit_router else self.router_sites)
        distributed.guard_hooks(handles)  # a failing hook skips its sample, never the forward
        self._collector = collector
        try:
            self._probe_forward()
        finally:
            self._collector = None
            for handle in handles:
                handle.remove()
        collector.finish()  # transformers attention that bypassed the interface: fall back
        self._explicit_qk |= bool(collector.explicit_qk)
        self._explicit_router |= bool(collector.explicit_router)
        qk = collector.explicit_qk if self._explicit_qk else collector.discovered_qk
        routers = collector.explicit_router if self._explicit_router \
            else collector.discovered_router
        probe_heads, probe_tokens = self._sampling_plan(qk)
        probe_autocast = self._probe_autocast()[1]
        for layer in sorted(qk):
            q, k, seq_len, sampled = qk[layer]
            if sampled is None:  # not sampled as it was captured: now
                q, k, seq_len, sampled = self._sample(q, k, seq_len, probe_heads, probe_tokens)
            heads, kv_head_of = sampled[1], sampled[2]
            subset = heads or None
            if self.broadcast_kv:
                k = k[list(kv_head_of)] if subset is not None else \
                    capture.broadcast_kv_heads(q, k)
                kv_head_of = ()
            record = pb.Record(step=step)
            record.qk.CopyFrom(pb.QKSample(
                layer=layer, probe_id=self.probe_id, causal=self.causal, seq_len=seq_len,
                q=encoding.encode_tensor(q, self.dtype), k=encoding.encode_tensor(k, self.dtype),
                kv_head_of=kv_head_of, heads=heads,
                attention_dtype=encoding.wire_dtype(
                    self._attention_dtype(collector, layer, q, probe_autocast)),
                logit_softcap=collector.softcaps.get(layer, 0.0)))
            check = collector.output_checks.get(layer)
            if check is not None:
                record.qk.output_check.CopyFrom(pb.AttentionOutputCheck(**check))
            self._emit(record)
        for layer in sorted(routers):
            logits, top_k = routers[layer]
            record = pb.Record(step=step)
            record.router.CopyFrom(pb.RouterSample(
                layer=layer, probe_id=self.probe_id, top_k=top_k,
                logits=encoding.encode_tensor(logits, self.router_dtype)))
            self._emit(record)
        if self._description is None:
            try:  # a description is never worth a probe
                dtypes = sorted({_dtype_name(self._attention_dtype(
                    collector, layer, qk[layer][0], probe_autocast)) for layer in qk})
                self._description = self._describe(sorted(qk), sorted(routers), dtypes)
                _announce(self._description)
            except Exception:  # noqa: BLE001
                self._description = ""
                log.debug("foreshock: describing the monitor failed", exc_info=True)
        self._counts["probes"] += 1
        self._probe_seconds += time.perf_counter() - start

    def describe(self):
        """One line saying what this monitor watches: the layers whose Q/K
        it captures, the routers, the attention dtype, curvature on or off,
        the cadence and the daemon. From the first probe on it is what that
        probe captured (also printed then, once, on the probing rank: to
        stderr, or through the "foreshock" logger when logging is set up);
        before it, what discovery found."""
        if self._description:
            return self._description
        return self._describe([s.layer for s in self.attention_sites],
                              [s.layer for s in self.router_sites], None)

    def _describe(self, qk_layers, router_layers, attention_dtypes):
        curvature = (f"on (every {self.curvature.every} steps)" if self.curvature is not None
                     else "off")
        dtype = ("the attention dtype known at the first probe" if attention_dtypes is None
                 else "attention computed in " + ("/".join(attention_dtypes) or "nothing"))
        return (f"foreshock: run {self.run_id} rank {self.rank}: Q/K of "
                f"{len(qk_layers)} attention layer(s) {_layer_list(qk_layers)}, "
                f"{len(router_layers)} router(s) {_layer_list(router_layers)}, {dtype}, "
                f"curvature {curvature}, a probe every {self.every} steps, to {self.endpoint}")

    def _attention_dtype(self, collector, layer, q, probe_autocast):
        """What the probe computed this layer's attention in (see attention_dtype)."""
        if self.attention_dtype is not None:
            return self.attention_dtype
        out = collector.output_dtypes.get(layer)
        if out is not None:
            return out
        if probe_autocast is not None and q.dtype == torch.float32:
            return probe_autocast  # matmuls and SDPA compute in the autocast dtype
        return q.dtype

    def _note_autocast(self, _module, _args):
        """Forward pre-hook: the autocast state of a training forward (not noted
        while torch.compile traces: a compiled run says autocast= or uses a callback)."""
        if self._collector is None and not _compiling():
            self._training_autocast = (self._device_type,
                                       capture.autocast_dtype(self._device_type))

    def _probe_autocast(self):
        """(device type, dtype) the probe runs under; dtype None: no autocast."""
        if self.autocast is False:
            return None, None
        if self.autocast is not None:
            return self._device_type, self.autocast
        if self._training_autocast is not None:
            return self._training_autocast
        return None, None

    def _sample(self, q, k, seq_len, probe_heads, probe_tokens):
        """One layer's q [H, N, d], k [Hkv, N, d] as this probe sends them:
        (q, k, seq_len, (full shape, heads, kv_head_of)), heads and
        kv_head_of empty when every head goes. Sampled tensors are copies:
        the whole layer's storage is not kept alive by a view."""
        full = (q.shape[0], k.shape[0], q.shape[1], q.shape[2], seq_len)
        n = q.shape[1]
        q, k, seq_len = sampling.token_subset(q, k, seq_len, probe_tokens)
        subset = sampling.head_subset(q.shape[0], k.shape[0], probe_heads,
                                      self._counts["probes"])
        heads, kv_head_of = (), ()
        if subset is not None:
            heads, kv_heads, kv_head_of = subset
            q, k = q[heads], k[kv_heads]  # indexing copies
        elif q.shape[1] != n:
            q, k = q.clone(), k.clone()
        return q, k, seq_len, (full, heads, kv_head_of)

    def _capture_reducer(self):
        """ProbeCollector's reduce: samples each layer as it is captured, with
        the plan of the previous probe when its layer shapes recur, or, on the
        first probe, the plan for as many layers of this one's shape as
        discovery found (or model_info says). None: nothing to sample by."""
        if self.max_probe_bytes is None and self.probe_heads is None \
                and self.probe_tokens is None:
            return None
        expected = len(self.attention_sites) or self.model_info.n_layers

        def reduce(q, k, seq_len):
            full = (q.shape[0], k.shape[0], q.shape[1], q.shape[2], seq_len)
            if self._plan_cache is None or full not in self._plan_cache[0]:
                if expected <= 0:
                    return q, k, seq_len, None
                self._plan_for((full,) * expected)
            heads, tokens, _ = self._plan_cache[1]
            return self._sample(q, k, seq_len, heads, tokens)

        return reduce

    def _plan_for(self, layers):
        if self._plan_cache is None or self._plan_cache[0] != layers:  # the same every probe
            self._plan_cache = (layers, sampling.plan(
                layers, encoding.itemsize(self.dtype), self.max_probe_bytes, self.probe_heads,
                self.probe_tokens))
        return self._plan_cache[1]

    def _sampling_plan(self, qk):
        """(query heads per layer, tokens) this probe sends (None: all): the
        explicit probe_heads/probe_tokens, and within max_probe_bytes."""
        layers = tuple(sampled[0] if sampled is not None else
                       (q.shape[0], k.shape[0], q.shape[1], q.shape[2], seq_len)
                       for q, k, seq_len, sampled in qk.values())
        itemsize = encoding.itemsize(self.dtype)
        heads, tokens, size = self._plan_for(layers)
        chosen = (heads, tokens)
        if chosen != (self.probe_heads, self.probe_tokens) and chosen != self._sampling_logged:
            self._sampling_logged = chosen
            full = sampling.plan(layers, itemsize, None)[2]
            most = max((h for h, _, _, _, _ in layers), default=0)
            log.info("foreshock: a full probe is %.1f MB of Q/K, over max_probe_bytes (%.1f MB): "
                     "sending %s query heads per layer (a rotating subset: every head every %d "
                     "probes) and %s tokens, %.1f MB", full / 1e6, self.max_probe_bytes / 1e6,
                     heads if heads is not None else "all",
                     sampling.probes_to_see_every_head(most, heads),
                     tokens if tokens is not None else "all", size / 1e6)
        return chosen

    def _probe_forward(self):
        """One no-grad eval-mode forward of the probe batch. Every module's own
        train/eval flag is put back afterwards (model.train(was_training) would
        switch modules the user keeps in eval, e.g. a frozen dropout, to train)."""
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        device_type, dtype = self._probe_autocast()
        try:
            with torch.no_grad(), capture.autocast_context(device_type, dtype):
                batch = self.probe_batch
                if isinstance(batch, Mapping):  # dict, or a tokenizer's BatchEncoding
                    self.model(**batch)
                elif isinstance(batch, (tuple, list)):
                    self.model(*batch)
                else:
                    self.model(batch)
        finally:
            for module, training in modes:
                module.training = training
            self._layout.after_probe()

    @property
    def run_id(self):
        return self._run_id

    @property
    def probe_is_collective(self):
        """The probe forward runs collectives (FSDP2, tensor parallel): every
        rank must run it at the same steps, those that do not send by join_probe()."""
        return self._layout.collective

    def join_probe(self):
        """The probe forward without capture, on a rank that does not send: the
        forward of a sharded (FSDP2) model is collective, so every rank runs it
        at the same steps. step() does this itself; for callers that schedule
        probes on their own (the Trainer and Lightning callbacks)."""
        start = time.perf_counter()
        self._probe_forward()
        self._counts["probes_joined"] += 1
        self._probe_seconds += time.perf_counter() - start

    def capture_qk(self, layer, q, k):
        """Hands the monitor this layer's Q and K; call it from the attention forward,
        after rotary embedding. q, k: [B, H, T, d] or [H, T, d]; K may have fewer
        (grouped-query) heads. Outside a probe forward it returns at once."""
        collector = self._collector
        if collector is None:
            return
        q, seq_len = capture.heads_tokens_from_bhtd(q)
        k, _ = capture.heads_tokens_from_bhtd(k)
        collector.add_qk(collector.explicit_qk, layer, q, k, seq_len)

    def check_attention_output(self, layer, q, k, v, out, scale=None, causal=None):
        """Hands the monitor this layer's attention output to check against an fp32
        reference: out = the model's softmax(q k^T * scale) v (q, out [B, H, T, d];
        k, v [B, Hkv, T, d]; scale default 1/sqrt(d); causal default the
        monitor's). Call it from the attention forward next to capture_qk, for
        plain softmax attention only: another mask or logit transform makes the
        reference differ. Outside a probe forward it returns at once."""
        collector = self._collector
        if collector is None or layer in collector.output_checks:
            return
        try:
            stats = output_check.check(q, k, v, out, scale=scale,
                                       causal=self.causal if causal is None else causal)
        except Exception as e:  # noqa: BLE001 - never break the user's forward
            if not self._output_check_warned:
                self._output_check_warned = True
                log.warning("foreshock: check_attention_output(layer %s) failed (%s); "
                            "not checked", layer, e)
            return
        collector.add_output_check(layer, stats)

    def capture_router(self, layer, logits, top_k):
        """Hands the monitor this MoE layer's router logits ([..., experts], before
        softmax) and its top-k. Outside a probe forward it returns at once."""
        collector = self._collector
        if collector is None:
            return
        collector.add_router(collector.explicit_router, layer, logits, top_k)

    @property
    def probing(self):
        """True while the probe forward runs (e.g. to skip work only training needs)."""
        return self._collector is not None

    # -- lifecycle ------------------------------------------------------------

    def stats(self):
        """Counters of the client: what was queued, sent, acked, rejected, lost or dropped."""
        stats = self._sender.stats()
        stats.update(self._counts, queued=len(self._queue),
                     probe_seconds_total=self._probe_seconds,
                     curvature_seconds_total=self._curvature_seconds,
                     train_seconds_total=self._train_seconds,
                     curvature_skipped_for_budget=getattr(self.curvature, "skipped_for_budget", 0))
        return stats

    def on_alert(self, callback):
        """Calls callback(event) for every alert transition of this run
        (foreshock.v1.AlertEvent: event.alert has alertname, layer, signal,
        probable_cause, first_step, ...; event.to_state is "pending", "firing"
        or "resolved"). It runs on a background thread, never the training
        thread: set a flag there and act on it in the training loop.

        The watch starts once the daemon has acknowledged this monitor's Hello
        (or after 10 s without one), so that a process resumed from a
        checkpoint under the same run_id is not handed the previous attempt's
        alerts as active: the daemon resolves them (resolved_reason
        "run_resumed") when it sees the new process (docs/DESIGN.md §3.4)."""
        if self._alerts is None:
            self._alerts = AlertWatcher(self.endpoint, self._run_id,
                                        channel_options=self._channel_options,
                                        security=self._security,
                                        ready=self._sender.hello_acked)
        self._alerts.add_callback(callback)

    def close(self, timeout=5.0, end=True):
        """Sends what is queued and waits for its acks for up to `timeout` s, then stops.

        With end (the default), this rank is done with the run: once every rank
        of the run has closed its monitor, the daemon marks the run ended and
        resolves its open alerts (resolved_reason "run_ended"; docs/DESIGN.md
        §3.4). end=False stops streaming without saying so (e.g. a process
        handing the run over to another)."""
        if not self._closed:
            self._closed = True
            if self._autocast_hook is not None:
                self._autocast_hook.remove()
                self._autocast_hook = None
            self._sender.close(timeout, goodbye=end)
            if self._alerts is not None:
                self._alerts.close(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _emit(self, record):
        if self._closed:
            self._counts["dropped_after_close"] += 1
            return
        if self.tap is not None:
            self.tap(record)
        if self._queue.put_nowait(record, record.ByteSize()):
            self._counts["enqueued"] += 1
        else:
            self._counts["dropped_queue_full"] += 1


_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _check_autocast(autocast):
    """Monitor(autocast=...): None, False, or a torch dtype of bf16/fp16."""
    if autocast is None or autocast is False:
        return autocast
    if isinstance(autocast, str) and autocast in _AUTOCAST_DTYPES:
        return _AUTOCAST_DTYPES[autocast]
    if autocast in (torch.bfloat16, torch.float16):
        return autocast
    raise ValueError(f"autocast must be None, False, 'bf16', 'fp16' or torch.bfloat16/float16, "
                     f"got {autocast!r}")


def _compiling():
    compiler = getattr(torch, "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    return bool(is_compiling is not None and is_compiling())


def _device_type(model):
    """The device type the model's parameters live on ("cpu" without any)."""
    for param in model.parameters():
        return param.device.type
    return "cpu"


def _layer_list(layers, shown=8):
    """'[0, 1, 2, ...]' with at most `shown` layers named."""
    names = [str(x) for x in layers[:shown]]
    return "[" + ", ".join(names) + (", ..." if len(layers) > shown else "") + "]"


def _dtype_name(dtype):
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return names.get(dtype, str(dtype).replace("torch.", "")) if isinstance(dtype, torch.dtype) \
        else str(dtype)


def _announce(line):
    """A line a user must see once without configuring anything: the
    "foreshock" logger's when logging is set up to show INFO, else stderr
    (a training script rarely configures logging)."""
    if log.hasHandlers() and log.isEnabledFor(logging.INFO):
        log.info("%s", line)
    else:
        print(line, file=sys.stderr, flush=True)


def _site_list(sites, shown=4):
    """': a (kind), b (kind), ... (N more)' for the discovery log line."""
    if not sites:
        return ""
    names = [f"{s.name} ({getattr(s, 'kind', 'router')})" for s in sites[:shown]]
    more = f", ... ({len(sites) - shown} more)" if len(sites) > shown else ""
    return ": " + ", ".join(names) + more
