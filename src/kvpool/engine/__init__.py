"""kvpool.engine"""
