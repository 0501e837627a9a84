package org.splitface.demo;

import android.content.Context;
import android.content.Intent;
import android.content.IntentFilter;
import android.os.BatteryManager;
import org.splitface.core.BatteryCounters;

/** BatteryManager's counters as they are; the core's EnergyMeter does all the arithmetic and the "unsupported" rule. */
final class AndroidBattery implements BatteryCounters {
    private final Context context;
    private final BatteryManager battery;

    AndroidBattery(Context context) {
        this.context = context;
        this.battery = (BatteryManager) context.getSystemService(Context.BATTERY_SERVICE);
    }

    @Override public Reading read() {
        Intent status = context.registerReceiver(null, new IntentFilter(Intent.ACTION_BATTERY_CHANGED));   // sticky
        int millivolts = status == null ? -1 : status.getIntExtra(BatteryManager.EXTRA_VOLTAGE, -1);
        return Reading.fromAndroid(System.nanoTime(),
                battery.getLongProperty(BatteryManager.BATTERY_PROPERTY_CHARGE_COUNTER),
                battery.getLongProperty(BatteryManager.BATTERY_PROPERTY_ENERGY_COUNTER),
                battery.getIntProperty(BatteryManager.BATTERY_PROPERTY_CURRENT_NOW),
                millivolts, battery.isCharging());
    }
}
