"""Speed and cost: tokens/s, sync seconds, training throughput, memory and scaling."""
