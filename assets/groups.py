"""The asset groups of the flow, in order: what each job selects and the summary reads."""

# group "data": one RL step's data path (partitioned by RL step)
DATA_ASSETS = ("rollout_snapshot", "tokenized_rollouts", "hidden_state_shards")
# groups "drafter" and "release": one refresh (partitioned by refresh step)
REFRESH_ASSETS = ("vocab_mapping", "drafter_checkpoint", "acceptance_eval",
                  "registered_drafter", "serving_drafter", "storage_retention")
# group "monitor": what the RL engine observed with the serving drafter (by RL step)
MONITOR_ASSETS = ("serving_acceptance",)
