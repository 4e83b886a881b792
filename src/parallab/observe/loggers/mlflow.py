"""MLflow, through its own client: a run per parallab run, its config as params, figures as
metric histories by step, a sweep's jobs as child runs of one parent run; a resumed run
logs into the MLflow run it started."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse
from typing import Any

from parallab.observe.loggers.base import Logger, RunInfo, Sender

log = logging.getLogger(__name__)

PARAM_LENGTH = 6000  # MLflow's limit on a param's value
BATCH = 100  # params per request (MLflow's limit)
METRICS_BATCH = 1000  # metrics per request (MLflow's limit)
NAME_LENGTH = 256  # an experiment's name column in MLflow's SQL stores
STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
# a tracker that stops answering costs the run's end (its last figures waited on) one
# request's tries, not MLflow's minutes of retries per request: about 5 s where it has gone
# (refused at once: the second retry's backoff, 4-5 s), about 35 s where it never answers
# (3 tries of 10 s), once: nothing is sent after the first failure (MLflow reads these at
# each request; the user's own settings win)
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
# the run dir's MLflow run: a resumed run (trainer.resume, a requeue) goes on in it, its
# curves one history, not split over two runs in the UI
RUN_FILE = "mlflow_run.json"


# the stores MLflow's client opens by URI scheme ('' : a local path), and the database
# drivers SQLAlchemy needs for them (a driver named after `+` in the scheme wins)
URI_SCHEMES = ("", "file", "http", "https", "sqlite", "postgresql", "mysql", "mssql",
               "databricks", "databricks-uc", "uc")
DRIVERS = {"postgresql": "psycopg2", "psycopg2": "psycopg2", "mysql": "pymysql",
           "pymysql": "pymysql", "mssql": "pyodbc", "pyodbc": "pyodbc"}


def _unsetting_on_error(method):
    """`method`, whose error makes RunLogger drop the logger without closing it: the HTTP
    defaults its run set go then, as at close."""
    @functools.wraps(method)
    def call(self, *args: Any) -> Any:
        try:
            return method(self, *args)
        except BaseException:
            self.unset_defaults()
            raise
    return call


class MLflowLogger(Logger):
    requires = "mlflow"

    def __init__(self, tracking_uri: str | None = None, experiment_name: str = "parallab",
                 run_name: str | None = None, send_every_s: float = 5.0,
                 run_id: str | None = None) -> None:
        self.send_every_s = send_every_s
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.client = None
        self.given_run_id = run_id or None  # an MLflow run to go on in, whatever the run dir's
        self.run_id: str | None = None
        self.params: set[str] = set()
        self.sender = Sender("mlflow", self.uri())
        self.pending: list[tuple[dict[str, float], int, int]] = []  # (figures, time, step)
        self.sent = 0.0  # when the last figures went to the sender
        self.defaulted: list[str] = []  # HTTP_DEFAULTS this run set, unset at close

    @classmethod
    def check(cls, tracking_uri: str | None = None, experiment_name: str = "parallab",
              **config: Any) -> str | None:
        if not experiment_name:
            return "logger.mlflow.experiment_name='' is empty: give a name"
        if len(experiment_name) > NAME_LENGTH:
            return (f"logger.mlflow.experiment_name={experiment_name[:40]}... is "
                    f"{len(experiment_name)} characters, longer than MLflow's database stores "
                    f"keep ({NAME_LENGTH}): give a shorter name")
        if not tracking_uri:
            return None
        scheme, _, driver = urlparse(tracking_uri).scheme.partition("+")
        if scheme not in URI_SCHEMES:
            return (f"logger.mlflow.tracking_uri={tracking_uri}: MLflow takes no {scheme!r} "
                    f"URI: use http(s)://HOST:PORT (a server), sqlite:///FILE, a database's "
                    "URI (postgresql://, mysql://, mssql://), or a local path")
        if scheme in ("", "file") and file_store_refused():
            return (f"logger.mlflow.tracking_uri={tracking_uri} is a file store, which the "
                    "installed MLflow refuses unless MLFLOW_ALLOW_FILE_STORE=true is set: use "
                    "sqlite:///PATH/mlflow.db, or set that variable")
        module = DRIVERS.get(driver or scheme)
        if module and importlib.util.find_spec(module) is None:
            return (f"logger.mlflow.tracking_uri={tracking_uri} needs the {module} driver, "
                    f"which is not installed: pip install {module}")
        return None

    @classmethod
    def writes(cls, **config: Any) -> list[str]:
        return [RUN_FILE]  # trainer.overwrite=true deletes it: the new run is a new MLflow run

    def uri(self) -> str:
        """The tracking URI: as set, else a local store in the outputs dir."""
        if self.tracking_uri:
            return self.tracking_uri
        return f"sqlite:///{Path('outputs').resolve() / 'mlflow.db'}"

    @_unsetting_on_error
    def start(self, run: RunInfo) -> None:
        uri = self.uri()
        answering(uri)
        self.defaulted = [name for name in HTTP_DEFAULTS if name not in os.environ]
        os.environ.update({name: HTTP_DEFAULTS[name] for name in self.defaulted})
        logging.getLogger("urllib3.connectionpool").addFilter(QUIET_RETRIES)
        if uri.startswith("sqlite:"):
            Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        from mlflow import MlflowClient

        self.client = MlflowClient(uri)
        found = self.client.get_experiment_by_name(self.experiment_name)
        # a local store's artifacts beside its database: MLflow's default is ./mlruns in the
        # dir the run was started from (a checkout's, a project's), whatever hydra.run.dir
        beside = (Path(uri.removeprefix("sqlite:///")).parent / "mlruns").as_uri() \
            if uri.startswith("sqlite:///") else None
        experiment = found.experiment_id if found else self.client.create_experiment(
            self.experiment_name, artifact_location=beside)
        if self.given_run_id is not None and run.sweep is not None:  # every job in one run
            log.warning("logger.mlflow.run_id=%s names one MLflow run, and each job of a sweep "
                        "logs into its own: it is not used here", self.given_run_id)
            self.given_run_id = None
        self.run_id = self.continued(run.run_dir, uri) or self.created(run, experiment)
        run.run_dir.mkdir(parents=True, exist_ok=True)
        (run.run_dir / RUN_FILE).write_text(json.dumps({
            "run_id": self.run_id, "tracking_uri": uri, "experiment": self.experiment_name}) + "\n")
        self.log_params(run.params)
        self.client.log_text(self.run_id, run.config_yaml, "config.yaml")
        log.info("mlflow: run %s in experiment %r at %s", self.run_id, self.experiment_name, uri)

    def created(self, run: RunInfo, experiment: str) -> str:
        tags = {**run.tags, "parallab.run_dir": str(run.run_dir),
                "parallab.overrides": " ".join(run.overrides)}
        if run.sweep is not None:
            tags["parallab.sweep"] = run.sweep
            tags["mlflow.parentRunId"] = self.parent(experiment, run.sweep)
        return self.client.create_run(experiment, run_name=self.run_name or run.name,
                                      tags=tags).info.run_id

    def continued(self, run_dir: Path, uri: str) -> str | None:
        """The MLflow run to go on in, running again: logger.mlflow.run_id's (as Lightning's),
        else the one an earlier start in this run dir logged into, if the tracker still has
        it; None (a new run) if there is none, or it is gone or elsewhere (one warning: a
        resume is no reason to lose the tracker)."""
        if self.given_run_id is not None:
            run_id, whose = self.given_run_id, f"logger.mlflow.run_id={self.given_run_id}"
        else:
            run_id, whose = self.earlier(run_dir, uri), "this run dir's MLflow run"
            if run_id is None:
                return None
        from mlflow.exceptions import MlflowException

        try:
            found = self.client.get_run(run_id)
        except MlflowException as error:
            if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            found = None
        if found is None or found.info.lifecycle_stage != "active":
            log.warning("logger.mlflow: %s %s is deleted or gone at %s: this start logs into a "
                        "new run (restore a deleted one, `mlflow runs restore --run-id %s`, to "
                        "go on in it)", whose, run_id, uri, run_id)
            return None
        self.client.update_run(run_id, "RUNNING")
        # MLflow refuses a param logged again with another value (a resume's longer
        # trainer.max_steps): the first start's values stay
        self.params.update(found.data.params)
        log.info("mlflow: run %s goes on (%s)", run_id, whose)
        return run_id

    def earlier(self, run_dir: Path, uri: str) -> str | None:
        """The MLflow run an earlier start in this run dir logged into, if at this tracker
        and experiment: another's is not this run's to go on in (one warning)."""
        try:
            earlier = json.loads((run_dir / RUN_FILE).read_text())
            run_id, was = earlier["run_id"], (earlier["tracking_uri"], earlier["experiment"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if was != (uri, self.experiment_name):
            log.warning("logger.mlflow: this run dir's MLflow run %s is in experiment %r at "
                        "%s: this start logs into a new run; give logger.mlflow.tracking_uri "
                        "and experiment_name as before to go on in it", run_id, was[1], was[0])
            return None
        return run_id

    def parent(self, experiment: str, sweep: str) -> str:
        """The sweep's parent run, made by its first job: one view of the sweep's jobs."""
        quoted = sweep.replace("'", "\\'")
        found = self.client.search_runs(
            [experiment], f"tags.`parallab.sweep` = '{quoted}' and tags.`parallab.parent` = "
            "'true'", max_results=1)
        if found:
            return found[0].info.run_id
        parent = self.client.create_run(experiment, run_name=sweep, tags={
            "parallab.sweep": sweep, "parallab.parent": "true"}).info.run_id
        self.client.set_terminated(parent)
        return parent

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # MLflow refuses a param logged twice with another value: new names only
        new = [Param(k, str(v)[:PARAM_LENGTH]) for k, v in params.items() if k not in self.params]
        self.params.update(params)
        for i in range(0, len(new), BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + BATCH])

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.sender.failed is not None:
            return
        now = time.time()
        self.pending.append((values, int(now * 1000), step))
        if now - self.sent >= self.send_every_s:
            self.flush(now)

    def flush(self, now: float) -> None:
        """The figures held so far, in one request on the sender's thread: a request per
        log step costs the training loop the GIL and the tracker its CPU."""
        if self.pending:
            self.sender.submit(self.send, self.pending)
            self.pending, self.sent = [], now

    def send(self, pending: list[tuple[dict[str, float], int, int]]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(k, float(v), stamp, step) for values, stamp, step in pending
                   for k, v in values.items()]
        for i in range(0, len(metrics), METRICS_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + METRICS_BATCH])

    @_unsetting_on_error
    def text(self, tag: str, markdown: str) -> None:
        if self.sender.failed is None:
            self.client.log_text(self.run_id, markdown, f"{tag}.md")

    @_unsetting_on_error
    def finish(self, final: dict[str, float], hparams: dict[str, Any], step: int) -> None:
        self.scalars(final, step)
        self.flush(time.time())
        self.sender.close()  # every figure sent before the run is closed
        if self.sender.failed is None:  # a tracker gone is said once, and not waited on again
            self.log_params(hparams)

    def close(self, status: str) -> None:
        self.flush(time.time())
        self.sender.close()
        try:
            if self.run_id is not None and self.sender.failed is None:
                self.client.set_terminated(self.run_id, STATUS.get(status, "FAILED"))
        finally:
            self.unset_defaults()

    def unset_defaults(self) -> None:
        """HTTP_DEFAULTS unset: a process that goes on (a notebook, a sweep's next job in
        it, the user's own MLflow calls) has MLflow's own again."""
        for name in self.defaulted:
            os.environ.pop(name, None)
        self.defaulted = []
        logging.getLogger("urllib3.connectionpool").removeFilter(QUIET_RETRIES)


class QuietRetries(logging.Filter):
    """urllib3's warning at each retry of a request to MLflow's REST API ("Retrying
    (Retry(total=1, ...)) after connection broken by ...: /api/2.0/mlflow/runs/log-batch"):
    a tracker that stops answering is parallab's one line, not those too. Another client's
    requests (the user's own, a data loader's) still say theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith("Retrying")):
            return True
        return not any("/mlflow/" in str(arg) or "/ajax-api/" in str(arg)
                       for arg in record.args or ())


QUIET_RETRIES = QuietRetries()


def file_store_refused() -> bool:
    """Whether the installed MLflow refuses a file store (`./mlruns`, `file:`): it does since
    it has MLFLOW_ALLOW_FILE_STORE, unless that is set to true."""
    from mlflow import environment_variables

    allowed = getattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE", None)
    return allowed is not None and not allowed.get()


def answering(uri: str, timeout_s: float = 3.0) -> None:
    """An http(s) tracker's health check answers, or ConnectionError within `timeout_s`
    (MLflow's own client would retry for minutes)."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
            return
    except urllib.error.HTTPError:
        return  # something answers (a proxy's own page): MLflow's client will tell
    except (OSError, ValueError) as error:
        raise ConnectionError(f"no MLflow server answers at {uri} "
                              f"({getattr(error, 'reason', error)})") from None
