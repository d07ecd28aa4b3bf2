"""The Downpour SGD estimator: its arguments and ``fit``.

:class:`DownpourSGD` follows scikit-learn: ``__init__`` stores the arguments, ``fit`` checks
them (:mod:`.arguments`) and the data before any cluster work, then hands one fit to the
:class:`~downpour_dask.downpour.driver.Driver` (placement, shards, replicas, supervision) and
keeps what it learned: ``params_``, ``experiment_``, ``server_status_``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from distributed import Client, Security

from .. import live
from ..base import ParamServerEstimator
from ..checkpoint import Checkpoint
from ..core import optim
from ..core.protocol import TrainableModel
from ..data.datasets import Dataset, ShardedDataset
from ..inputs import evaluation_data, prepare_before_cluster, prepare_fit
from ..log import Progress
from ..runtime.cluster import cluster_client
from .arguments import DownpourArguments
from .checkpoints import read_resumable
from .driver import Driver
from .replica_count import resolve_settings
from .settings import FitSettings, from_arguments, replica_subsets


class DownpourSGD(DownpourArguments, ParamServerEstimator):
    """Downpour SGD (Dean et al., 2012) on a Dask cluster.

    Parameters
    ----------
    model : model, str or None, default None
        A model (``models.MLP(784, (128,), 10)``, ``models.from_jax(...)``, any object of the
        protocol in :mod:`downpour_dask.core.protocol`) or a spec (``"mlp:128,64"``, ``"mlp"``,
        ``"softmax"``, ``"logistic"``, ``"linear"``, ``"cnn"``) built at fit for the data; None
        is ``"mlp"``.  A classifier model makes this a scikit-learn classifier (labels of any
        kind, kept in ``classes_``), ``"linear"`` or a regression model a regressor.
    n_replicas : int or "auto", default 4
        Model replicas; each trains on its own 1/n_replicas of the data.  ``"auto"``: one per
        worker at the start and one on each worker that joins (up to ``max_replicas``).
    n_shards : int, default 2
        Parameter-server shards (Dask actors), placed on distinct workers where possible.  A small
        model trains faster on one: each shard costs a replica messages on every push.
    optimizer : str or UpdateRule, default "adagrad"
        Update rule the shards apply: a name (:data:`downpour_dask.optim.OPTIMIZERS`, each
        also as ``"dc_<name>"``, delay-compensated), a name with hyperparameters
        (``"adam:beta2=0.95"``, :mod:`~.core.optimizer_spec`), or an
        :class:`~downpour_dask.optim.UpdateRule` (then ``learning_rate`` must equal its rate).
    learning_rate : float, default 0.05
        The rule's rate (Adagrad's gamma).
    batch_size : int, default 64
        Minibatch size of each replica step.
    n_fetch, n_push : int, default 1
        A replica fetches parameters every ``n_fetch`` steps and pushes its accrued gradient every
        ``n_push`` steps (the paper's experiments used 1 and 1).
    max_inflight : int, default 4
        Pushes a replica may have sent and not yet seen acknowledged before it waits
        (back-pressure).  More hides more round-trip latency when steps are short, but lets a
        replica run further ahead of the shards.
    local_learning_rate : float, optional
        The replicas' rate ``alpha`` between fetches; default ``learning_rate`` (0: overwrite).
    warmstart_steps : int, default 0
        Steps replica 0 trains alone before the other replicas start.
    max_epochs, max_steps : int, optional
        Each replica stops after this many passes over its own data / this many steps.
    max_seconds : float, optional
        Wall-clock budget of training; the replicas are stopped when it runs out.
        If none of the three limits is given, each replica does one epoch.
    eval_every : float, default 0.5
        Seconds between evaluations of the current parameters on ``eval_data``.
    random_state : int, optional
        Seeds the initial parameters and every replica's data order.
    timeout : float, default 120
        Seconds any single call into a shard may take before the run fails instead of hanging.
    security : distributed.Security or True, optional
        TLS for the embedded local cluster started when ``fit`` gets no client: ``True`` for
        temporary self-signed certificates (``Security.temporary()``), or a ``Security`` with
        certificates for every role.  That cluster then listens on TLS only.  Give a client of
        an existing cluster its own ``security`` instead.
    checkpoint_dir : str or path, optional
        Directory for periodic checkpoints of every shard (values, update-rule state, version)
        and of the experiment log so far, and for one when the fit ends;
        ``fit(..., resume_from=checkpoint_dir)`` continues from the latest one.  See
        :mod:`downpour_dask.checkpoint` for the layout.
    checkpoint_every : float, default 30
        Seconds between checkpoints.  The driver also keeps the latest one in memory (even
        without ``checkpoint_dir``) to restore a shard whose worker dies.
    partitions : int, default 1
        Model parallelism: split every replica of an MLP into this many partitions on as many
        different workers, by neurons (partition p owns the p-th block of units of every hidden
        layer; see :mod:`downpour_dask.core.partition`).  Each partition fetches and pushes only its
        own parameters, from shards that hold nothing else (``n_shards >= partitions``); only
        activations and their gradients that cross partitions travel.  Needs an MLP, at most as
        many partitions as the narrowest hidden layer has units, and as many workers.
    transport : {"auto", "one-sided", "dask"}, default "auto"
        How a replica reaches shards on other workers.  ``"auto"``: a direct TCP connection per
        shard (:mod:`downpour_dask.ps.wire`) where the cluster's comm is plain TCP, else Dask
        actor messages; it costs far less CPU per push and pull than an actor call, CPU that
        goes to the gradients instead.  ``"one-sided"``: as ``"auto"``, but a shard on another
        worker of the replica's own host is updated by the replica itself, in shared memory
        under a lock both processes take, waking nothing in the shard's process
        (:mod:`downpour_dask.ps.one_sided`; Linux; the shards of a delay-compensated
        ``"dc_"`` rule stay on the wire).  ``"dask"``: actor messages only.  Shards on the
        replica's own worker are called in-process in every case.
    verbose : int, default 0
        0 is silent.  1 or more: a progress bar while ``fit`` runs (unless it is given a
        ``callback``), and the dashboard link of an embedded cluster it starts, on stderr.
    warm_start : bool, default False
        When True, ``fit`` continues from the previous fit's ``params_`` (same model, classes
        and features) instead of starting afresh, as scikit-learn's ``warm_start``.
    max_grad_norm : float, optional
        Clip every pushed gradient to this L2 norm, measured by each shard over its own slice
        (so no shard waits for the others).  Whatever it is, a push whose update would make
        parameters or update-rule state non-finite is refused (``gradient_refused``), and a fit
        that ends diverged raises ``FloatingPointError``.
    consistency : {"async", "ssp", "bsp"}, default "async"
        How far replicas may drift apart (:mod:`downpour_dask.core.consistency`): ``"async"`` is
        Downpour's; ``"ssp"`` blocks a replica more than ``staleness_bound`` pushes ahead of the
        slowest (on the shards' clock); ``"bsp"`` is ``staleness_bound=0``, synchronous SGD.
    staleness_bound : int, optional
        SSP's bound ``s`` (default 3); only with ``consistency="ssp"`` (``"bsp"`` is 0).
    top_k : float, optional
        Compressed pushes: send each shard only this share of its coordinates, the largest,
        keeping the rest on the replica for later pushes (:mod:`~.core.compression`); the
        push log's ``bytes_sent`` shows the saving.  None (the default) sends dense pushes.
    elastic_alpha : float, optional
        Asynchronous EASGD instead of Downpour: replicas train their own variables and every
        ``n_push`` steps (tau) exchange ``elastic_alpha * (x_i - centre)`` with the centre on
        the shards (:mod:`~.downpour.easgd_loop`); needs ``optimizer="sgd"``.
    max_replicas : int, optional
        Start replicas on workers that join while the fit runs, up to this many (>= n_replicas).
    ema_decay : float, optional
        Publish an exponential moving average of the shards' parameters as the model (its
        evaluations and ``params_``), with this decay per push each shard applies (0.98: about
        the last 50); replicas keep training the parameters themselves.  It takes the
        asynchrony's noise out of the model (:mod:`~.core.averaging`).  None: no average.

    Attributes
    ----------
    model_ : model
        The model trained (``model`` itself, or built from its spec).
    params_ : ndarray
        The trained flat float32 parameter vector.
    classes_ : ndarray
        The class labels (classifiers); the model's output ``k`` is ``classes_[k]``.
    n_features_in_ : int
        Features seen in fit; ``feature_names_in_`` too when X had string column names.
    experiment_ : Experiment
        Pushes, evaluations and events of the run.  Each event's ``data`` holds its facts for
        code to read (its ``detail`` is a sentence for people); the kinds and their data are
        listed in :mod:`downpour_dask.downpour`.  Its config's ``shard_incarnations`` lists
        every replaced shard incarnation and the updates lost with it.
    server_status_ : DataFrame
        Per-shard counters at the end of the run (versions, accepted/refused pushes, staleness,
        ``generation``, and ``lost_updates``: updates the replaced incarnations of the shard
        had acknowledged that its final state lacks).

    Notes
    -----
    SGD has no convergence test here: ``max_epochs``/``max_steps`` say how long to train.  A
    fit warns with :class:`sklearn.exceptions.ConvergenceWarning` when ``max_seconds`` stopped
    it before the epochs or steps it was given, or when no update reached the shards at all
    (the model is then untrained).
    """

    def __init__(
        self,
        model: TrainableModel | str | None = None,
        n_replicas: int | Literal["auto"] = 4,
        n_shards: int = 2,
        optimizer: str | optim.UpdateRule = "adagrad",
        learning_rate: float = 0.05,
        batch_size: int = 64,
        n_fetch: int = 1,
        n_push: int = 1,
        max_inflight: int = 4,
        local_learning_rate: float | None = None,
        warmstart_steps: int = 0,
        max_epochs: int | None = None,
        max_steps: int | None = None,
        max_seconds: float | None = None,
        eval_every: float = 0.5,
        random_state: int | None = None,
        timeout: float = 120.0,
        security: Security | bool | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: float = 30.0,
        partitions: int = 1,
        transport: str = "auto",
        verbose: int = 0,
        warm_start: bool = False,
        max_grad_norm: float | None = None,
        consistency: str = "async",
        staleness_bound: int | None = None,
        top_k: float | None = None,
        elastic_alpha: float | None = None,
        max_replicas: int | None = None,
        ema_decay: float | None = None,
    ):
        self.model = model
        self.n_replicas = n_replicas
        self.n_shards = n_shards
        self.optimizer = optimizer
        self.learning_rate = learning_rate
        self.batch_size = batch_size
        self.n_fetch = n_fetch
        self.n_push = n_push
        self.max_inflight = max_inflight
        self.local_learning_rate = local_learning_rate
        self.warmstart_steps = warmstart_steps
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        self.eval_every = eval_every
        self.random_state = random_state
        self.timeout = timeout
        self.security = security
        self.checkpoint_dir = checkpoint_dir
        self.checkpoint_every = checkpoint_every
        self.partitions = partitions
        self.transport = transport
        self.verbose = verbose
        self.warm_start = warm_start
        self.max_grad_norm = max_grad_norm
        self.consistency, self.staleness_bound = consistency, staleness_bound
        self.top_k, self.elastic_alpha = top_k, elastic_alpha
        self.max_replicas, self.ema_decay = max_replicas, ema_decay

    # -- fitting ---------------------------------------------------------------------------------
    def fit(
        self,
        data: Dataset | ShardedDataset | tuple | np.ndarray,
        y: np.ndarray | None = None,
        *,
        eval_data: Dataset | tuple | None = None,
        client: Client | None = None,
        callback: Callable[[Progress], None] | None = None,
        publish: str | None = None,
        resume_from: str | os.PathLike[str] | None = None,
    ) -> DownpourSGD:
        """Train with Downpour SGD; returns ``self``.

        Parameters
        ----------
        data : array-like, DataFrame, Dask Array/DataFrame, Dataset, ShardedDataset or (X, y)
            Training data; with ``X``, pass the targets as ``y`` (any labels for a classifier).
            Dask collections (``fit(dask_X, dask_y)``, or ``datasets.from_dask``) and files
            (``datasets.from_parquet``, ``from_npy``, ``from_csv``) stay distributed: each
            replica streams only its own partitions or files, on its worker, and nothing is
            gathered here (a classifier's classes come from one pass over the labels there).
        y : array-like, Dask Array or Series, optional
            Targets for ``data`` given as ``X``.
        eval_data : Dataset or (X, y), optional
            Evaluated every ``eval_every`` seconds and at the end (``experiment_.evals``).
        client : distributed.Client, optional
            The cluster; by default the current Dask client, else an embedded local cluster
            started and closed here (pinned when replicas >= workers: ``cluster_client``).
        callback : callable, optional
            Called with a :class:`~downpour_dask.log.Progress` snapshot about four times a
            second while training (progress bars, live plots).  An exception it raises stops
            the replicas and propagates out of ``fit``.
        publish : str, optional
            Publish the running parameter server on the cluster under this name, so other
            processes can follow it with ``downpour_dask.attach(name, client)`` or
            ``downpour-dask watch NAME``; progress is logged under the scheduler event topic
            ``downpour-dask/<name>``.  Unpublished when ``fit`` returns or fails.
        resume_from : str or path, optional
            A ``checkpoint_dir`` of an interrupted fit with the same model, ``n_shards`` and
            data: the shards start from its latest checkpoint (values, update-rule state,
            versions), each replica skips the steps it had pushed, and the experiment continues
            the old one's pushes, evaluations, events and time axis (up to the checkpoint).
            Checkpoints go on being written there unless ``checkpoint_dir`` is set.
        """
        rule = self._check_arguments(callback)
        callback = self._callback(callback)
        if publish is not None:
            live.check_name(publish)
        model, train, evaluation = prepare_before_cluster(self, data, y, eval_data)
        if train is not None and self.n_replicas != "auto":  # in memory, files: rows for each
            replica_subsets(train, self.n_replicas)
        resumed = self._resumed(resume_from, model, rule)  # (None until the model is known)
        busy = float("inf") if self.n_replicas == "auto" else self.n_replicas  # "auto": 1 a worker
        with cluster_client(client, self.security, self.verbose >= 1, busy) as active:
            if model is None:  # Dask collections: their labels are read on the cluster
                model, train = prepare_fit(self, data, y, active)
                evaluation = evaluation_data(self, model, eval_data)
                resumed = self._resumed(resume_from, model, rule)
            settings = self._settings(model, rule, self.checkpoint_dir or resume_from)
            settings = resolve_settings(settings, active)  # n_replicas="auto": on its workers
            driver = Driver(
                settings, active, replica_subsets(train, settings.n_replicas), evaluation, resumed,
                callback, publish,
            )  # fmt: skip
            driver.execute()
        self.model_ = model
        self.params_ = driver.params
        self.experiment_ = driver.experiment
        self.server_status_ = driver.status
        events = driver.experiment.events["kind"]
        asked = {"max_epochs": self.max_epochs, "max_steps": self.max_steps}
        self._warn_stopped(bool(len(driver.experiment.pushes)), (events == "stop_requested").any(),
                           {k: v for k, v in asked.items() if v is not None})  # fmt: skip
        return self

    def _resumed(
        self, resume_from: Any, model: TrainableModel | None, rule: optim.UpdateRule
    ) -> Checkpoint | None:
        """The checkpoint ``fit`` resumes from, checked against ``model`` (None without
        ``resume_from``, or while the model is not known); a damaged file raises
        :class:`~downpour_dask.checkpoint.CheckpointError` (a ValueError) naming it."""
        if resume_from is None or model is None:
            return None
        ranges = self._shard_ranges(model)
        return read_resumable(resume_from, ranges, self.partitions, model, rule)

    def _settings(
        self,
        model: TrainableModel,
        rule: optim.UpdateRule,
        checkpoint_dir: str | os.PathLike[str] | None,
    ) -> FitSettings:
        """What the driver needs of the checked arguments."""
        alpha = self.learning_rate if self.local_learning_rate is None else self.local_learning_rate
        max_epochs = self.max_epochs
        if max_epochs is None and self.max_steps is None and self.max_seconds is None:
            max_epochs = 1
        return from_arguments(
            self.get_params(), model=model, rule=rule, ranges=self._shard_ranges(model),
            plan=self._plan(model), local_learning_rate=alpha, max_epochs=max_epochs,
            checkpoint_dir=checkpoint_dir, config=self._config(model),
            initial=self._initial_params(), consistency=self._consistency(),
        )  # fmt: skip

    def _config(self, model: TrainableModel) -> dict[str, Any]:
        """The estimator's part of the experiment's config (JSON-able): the shared part, with the
        optimizer as its config and the checkpoint directory as a string."""
        config = super()._config(model)
        if config.get("checkpoint_dir") is not None:
            config["checkpoint_dir"] = str(config["checkpoint_dir"])
        if isinstance(self.optimizer, optim.UpdateRule):
            config["optimizer"] = self.optimizer.get_config()
        return {**config, **self._consistency().config()}  # the bound SSP runs with
