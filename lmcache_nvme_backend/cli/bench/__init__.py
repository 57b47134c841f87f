"""cli/bench"""
