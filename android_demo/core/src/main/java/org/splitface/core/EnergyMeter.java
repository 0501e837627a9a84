package org.splitface.core;

import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;

/**
 * Energy per batch from the battery's own counters ({@link BatteryCounters}): read at the batch's start, every
 * `periodMs` during it, and at its end. Energy: the ENERGY_COUNTER's drop (nWh), else CURRENT_NOW integrated over
 * the readings (trapezoids, its magnitude: phones differ in its sign) times the voltage read with it, else the
 * CHARGE_COUNTER's drop times the mean of the two voltages; charge likewise from CURRENT_NOW, else CHARGE_COUNTER.
 * Nothing is assumed: a counter the phone lacks gives nothing, and a batch with any reading while charging is not
 * measured (the counters then see the charger).
 */
public final class EnergyMeter implements AutoCloseable {
    private final BatteryCounters counters;
    private final long periodMs;
    private final ScheduledExecutorService sampler;
    private ScheduledFuture<?> task;
    private final List<BatteryCounters.Reading> readings = new ArrayList<>();

    /** periodMs: how often CURRENT_NOW is read during a batch (0: only at start and stop, and on {@link #sample}). */
    public EnergyMeter(BatteryCounters counters, long periodMs) {
        this.counters = counters;
        this.periodMs = periodMs;
        this.sampler = periodMs > 0 ? Executors.newSingleThreadScheduledExecutor(r -> {
            Thread t = new Thread(r, "splitface-battery");
            t.setDaemon(true);
            return t;
        }) : null;
    }

    public synchronized void start() {
        readings.clear();
        readings.add(counters.read());
        if (sampler != null) task = sampler.scheduleAtFixedRate(this::sample, periodMs, periodMs, TimeUnit.MILLISECONDS);
    }

    public synchronized void sample() { readings.add(counters.read()); }

    /** The batch since {@link #start}. */
    public BatchEnergy stop() {
        if (task != null) task.cancel(false);
        synchronized (this) {
            if (readings.isEmpty()) throw new IllegalStateException("stop() before start()");
            readings.add(counters.read());
            return measure(readings);
        }
    }

    @Override public void close() { if (sampler != null) sampler.shutdownNow(); }

    /** The arithmetic on a batch's readings, in time order (first: its start, last: its end). */
    public static BatchEnergy measure(List<BatteryCounters.Reading> r) {
        for (BatteryCounters.Reading x : r) if (x.charging()) return new BatchEnergy(null, null, null, true);
        BatteryCounters.Reading first = r.get(0), last = r.get(r.size() - 1);
        Double mah = null, mj = null;
        List<String> sources = new ArrayList<>();
        String note = null;
        if (first.energyNanoWh() != null && last.energyNanoWh() != null) {
            long drop = first.energyNanoWh() - last.energyNanoWh();
            if (drop > 0) { mj = drop * 3.6e-3; sources.add("ENERGY_COUNTER"); }   // 1 nWh = 3.6e-3 mJ
            else note = "ENERGY_COUNTER did not fall over this batch";
        }
        boolean current = r.size() >= 2, volts = true;
        for (BatteryCounters.Reading x : r) {
            current &= x.currentMicroA() != null;
            volts &= x.voltageMillivolts() != null;
        }
        if (current) {
            double microAh = 0, nanoJ = 0;
            for (int k = 1; k < r.size(); k++) {
                BatteryCounters.Reading a = r.get(k - 1), b = r.get(k);
                double seconds = (b.nanos() - a.nanos()) / 1e9;
                double ia = Math.abs(a.currentMicroA()), ib = Math.abs(b.currentMicroA());
                microAh += (ia + ib) / 2 * seconds / 3600;
                if (volts) nanoJ += (ia * a.voltageMillivolts() + ib * b.voltageMillivolts()) / 2 * seconds;   // uA x mV = nW
            }
            mah = microAh / 1000;
            boolean energy = mj == null && volts;
            if (energy) mj = nanoJ * 1e-6;
            sources.add("CURRENT_NOW" + (energy ? " x voltage" : "") + ", " + r.size() + " readings");
        } else if (first.chargeMicroAh() != null && last.chargeMicroAh() != null) {
            long drop = first.chargeMicroAh() - last.chargeMicroAh();
            if (drop > 0) {
                mah = drop / 1000.0;
                boolean energy = mj == null && first.voltageMillivolts() != null && last.voltageMillivolts() != null;
                if (energy) mj = drop * (first.voltageMillivolts() + last.voltageMillivolts()) / 2.0 * 3.6e-3;   // uAh x mV = nWh
                sources.add("CHARGE_COUNTER" + (energy ? " x voltage" : ""));
            } else if (note == null) {
                note = "CHARGE_COUNTER did not fall over this batch (its steps are coarser than a batch)";
            }
        }
        if (mah == null && mj == null) return new BatchEnergy(null, null, note, false);
        return new BatchEnergy(mah, mj, String.join("; ", sources), false);
    }
}
