"""kvpool.attention"""
