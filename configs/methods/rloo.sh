# RLOO (Ahmadian et al. 2024, arXiv 2402.14740): A = R - mean of the other K-1 rewards = K/(K-1)(R - mean) (OpenRLHF rloo; PPO clip 0.2, token-mean).
METHOD_ARGS=(--algo.advantage.estimator rloo)
