"""The peer all-reduce that feeds the fused boundary's y: symmetric slots, one-shot and two-shot, bounded waits."""
