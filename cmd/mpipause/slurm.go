package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/mpipause/mpipause/internal/ctl"
)

const slurmIDHelp = `Under Slurm (the SPANK plugin, docs/slurm.md) a step's job is JOBID.STEPID;
a bare Slurm job id names the job of its one step on this node.`

// slurmStep finds the job a bare Slurm job id names. Slurm's SPANK plugin
// (slurm/) names each step's job JOBID.STEPID, but users know the number
// squeue and scontrol show: so when no job on this node is called id and id
// is all digits, the one job here called id.STEP is meant. err is the
// answer to id itself, returned unchanged when that does not apply.
func slurmStep(ctx context.Context, id string, err error) (string, error) {
	var ce *ctl.Error
	if !errors.As(err, &ce) || ce.Code != ctl.CodeUnknownJob || strings.Trim(id, "0123456789") != "" {
		return "", err
	}
	rep, lerr := ctl.Do(ctx, ctl.Addr(), ctl.Request{Op: ctl.OpList}, nil)
	if lerr != nil {
		return "", err
	}
	var steps []string
	for _, j := range rep.Jobs {
		if step, ok := strings.CutPrefix(j.ID, id+"."); ok && step != "" && strings.Trim(step, "0123456789") == "" {
			steps = append(steps, j.ID)
		}
	}
	slices.Sort(steps)
	switch len(steps) {
	case 0:
		return "", err
	case 1:
		return steps[0], nil
	}
	return "", usageError{fmt.Sprintf("Slurm job %s has %d steps on this node: %s; say which one (mpipause %s)",
		id, len(steps), strings.Join(steps, ", "), steps[0])}
}
