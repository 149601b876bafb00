"""kvpool.cache"""
