package main

import "context"

func cmdRun(ctx context.Context, args []string, io stdio) int  { return 1 }
func cmdDemo(ctx context.Context, args []string, io stdio) int { return 1 }
func cmdAPI(ctx context.Context, args []string, io stdio) int  { return 1 }
func cmdPool(ctx context.Context, args []string, io stdio) int { return 1 }
func wireProblems(c *config) configErrors                      { return nil }
