package org.splitface.demo;

import android.content.Context;
import android.content.Intent;
import android.content.IntentFilter;
import android.os.BatteryManager;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.ScheduledFuture;
import java.util.concurrent.TimeUnit;

/**
 * Charge drawn over a batch: CURRENT_NOW (uA) sampled every 200 ms and integrated, and the
 * CHARGE_COUNTER (uAh) delta for longer spans. Phones that do not report these give null, and
 * readings while charging over USB are not the battery's: {@link #charging} says so.
 */
final class BatteryMeter {
    private final BatteryManager battery;
    private final Context context;
    private final ScheduledExecutorService sampler = Executors.newSingleThreadScheduledExecutor();
    private ScheduledFuture<?> task;
    private double microAmpHours;
    private long lastNanos;
    private boolean currentAvailable;
    private long chargeStart;

    BatteryMeter(Context context) {
        this.context = context;
        this.battery = (BatteryManager) context.getSystemService(Context.BATTERY_SERVICE);
    }

    boolean charging() { return battery.isCharging(); }

    /** Volts from the sticky ACTION_BATTERY_CHANGED broadcast, or null. */
    Double volts() {
        Intent status = context.registerReceiver(null, new IntentFilter(Intent.ACTION_BATTERY_CHANGED));
        int mv = status == null ? -1 : status.getIntExtra(BatteryManager.EXTRA_VOLTAGE, -1);
        return mv > 0 ? mv / 1000.0 : null;
    }

    synchronized void start() {
        microAmpHours = 0;
        currentAvailable = true;
        lastNanos = System.nanoTime();
        chargeStart = battery.getLongProperty(BatteryManager.BATTERY_PROPERTY_CHARGE_COUNTER);
        task = sampler.scheduleAtFixedRate(this::sample, 0, 200, TimeUnit.MILLISECONDS);
    }

    private synchronized void sample() {
        long now = System.nanoTime();
        int microAmps = battery.getIntProperty(BatteryManager.BATTERY_PROPERTY_CURRENT_NOW);
        if (microAmps == Integer.MIN_VALUE || microAmps == 0) { currentAvailable = false; return; }
        // Sign conventions differ between phones; the magnitude is the drain while discharging.
        microAmpHours += Math.abs(microAmps) * ((now - lastNanos) / 3.6e12);
        lastNanos = now;
    }

    /** mAh drawn since start() from CURRENT_NOW, or null where the phone does not report it. */
    synchronized Double stopMilliAmpHours() {
        task.cancel(false);
        sample();
        return currentAvailable ? microAmpHours / 1000.0 : null;
    }

    /** mAh from CHARGE_COUNTER since start(), or null where unsupported (coarse: use over many batches). */
    Double counterMilliAmpHours() {
        long end = battery.getLongProperty(BatteryManager.BATTERY_PROPERTY_CHARGE_COUNTER);
        if (chargeStart == Long.MIN_VALUE || end == Long.MIN_VALUE || chargeStart <= 0) return null;
        return (chargeStart - end) / 1000.0;
    }
}
