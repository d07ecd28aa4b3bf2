"""Train an MLP on the shipped mnist5k with Downpour SGD + Adagrad on an embedded local cluster.

    python examples/mnist5k.py

Prints the test accuracy, the run's headline numbers and the per-shard counters, and saves the
experiment log to runs/mnist5k-example/.
"""

from downpour_dask import DownpourSGD, datasets, models

if __name__ == "__main__":  # worker processes re-import this file; only the parent trains
    train, test = datasets.load("mnist5k")
    est = DownpourSGD(
        models.MLP(n_inputs=784, hidden=(128,), n_outputs=10),
        n_replicas=4,
        n_shards=2,
        optimizer="adagrad",
        learning_rate=0.05,
        batch_size=32,
        warmstart_steps=100,
        max_epochs=3,
        random_state=0,
    )
    est.fit(train, eval_data=test)  # no client: starts and closes a local cluster
    print(f"test accuracy: {est.score(test):.3f}")
    summary = est.experiment_.summary()
    print({k: round(v, 3) for k, v in summary.items()})
    print(est.server_status_[["shard", "worker", "start", "stop", "version", "accepted"]])
    print("saved to", est.experiment_.save("runs/mnist5k-example", overwrite=True))
